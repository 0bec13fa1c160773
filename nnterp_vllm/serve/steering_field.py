"""A request's ``steering`` field, read with errors that name the field.

Every check is one of `nnterp_vllm.arguments`' (the ones `Steering` and ``steer`` run), called per field
so a refusal names the field it is about (``param``, as in OpenAI's error format: ``steering[1].vector``).
A field is read in two steps: `read_steering` checks everything the model's sizes tell (it runs off the
event loop, as the request arrives: `intake`); `with_vectors` then puts in the registered vectors the
specs name. Nothing here needs vLLM: the model's sizes come in as numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import arguments
from ..specs.patch import PATCHED_VALUES, Patch
from ..specs.probes import OPERATORS
from ..specs.saes import SAE
from ..specs.steering import EVERYWHERE, SCALES, Ablate, Cap, Clamp, Steering, unit_direction
from ..specs.steering_requests import KINDS, kind_fields
from .errors import InvalidField, naming
from .intake import hand_over
from .probes_field import read_probe
from .registry import Vector

#: The fields of one steering spec, in the order they are checked.
SPEC_FIELDS = (
    "kind",
    "layers",
    "vector",
    "vectors",
    "factor",
    "min",
    "max",
    "sae",
    "feature",
    "value",
    "scale",
    "positions",
    "when",
)
#: The fields only one kind of spec takes (`specs.KINDS`).
OWN_FIELDS = tuple(name for _, names in KINDS.values() for name in names)
#: Specs one request may carry per block of the model, unless the server is told otherwise.
SPECS_PER_LAYER = 4


def read_steering(
    steering: Any, num_layers: int, hidden_size: int, max_specs: int, max_relative_dose: float | None = None
) -> list[dict[str, Any]]:
    """A request's ``steering`` field (``None``, or a list of at most ``max_specs`` spec objects), checked
    against the model's sizes: each spec as ``{"kind", "layers", "vector", "positions"}`` and its kind's own
    fields (`KINDS`: an ``"add"``'s ``factor`` and ``scale``, a ``"cap"``'s ``min`` and ``max``), its vector a float32
    tensor, or the registered name it gives (put in by `with_vectors`). A relative add spec whose factor's magnitude
    exceeds ``max_relative_dose`` (``--max-relative-dose``; ``None``: no bound) is refused. Raises `InvalidField`."""
    if steering is None:
        return []
    if not isinstance(steering, list):
        raise InvalidField(
            f"steering must be a list of specs, each {{'layers', 'vector', 'factor', 'positions'}}, got "
            f"{type(steering).__name__}",
            "steering",
        )
    if len(steering) > max_specs:
        raise InvalidField(
            f"steering holds {len(steering)} specs; this server takes at most {max_specs} per request "
            "(--max-steering-specs): add vectors meant for the same layers and positions into one spec",
            "steering",
        )
    specs = []
    for i, spec in enumerate(steering):
        specs.append(_read_spec(spec, f"steering[{i}]", num_layers, hidden_size, max_relative_dose))
        hand_over()  # a spec's numbers are checked one by one: the event loop's thread runs between specs
    return specs


def _read_spec(
    spec: Any, where: str, num_layers: int, hidden_size: int, max_relative_dose: float | None = None
) -> dict[str, Any]:
    if not isinstance(spec, dict):
        raise InvalidField(
            f"{where}: a steering spec is an object with 'layers', 'vector' and optionally 'kind' ('add', 'ablate' "
            f"or 'cap'), 'factor' and 'scale' (add), 'min' and 'max' (cap) and 'positions', got {type(spec).__name__}",
            where,
        )
    for name in spec:
        if name not in SPEC_FIELDS:
            raise InvalidField(
                f"{where}: unknown field {name!r}; a spec has {', '.join(SPEC_FIELDS)}", f"{where}.{name}"
            )
    kind = _kind(spec, where)
    if "when" in spec and kind == "patch":
        raise InvalidField(
            f"{where}: a 'patch' spec is not gated; 'when' gates add, ablate, cap and clamp specs", f"{where}.when"
        )
    when = read_when(spec["when"], f"{where}.when", hidden_size) if "when" in spec else None
    if kind == "clamp":
        return {**_read_clamp(spec, where), "when": when}
    if kind == "patch":
        return _read_patch(spec, where, num_layers, hidden_size)
    if "vector" not in spec:
        raise InvalidField(f"{where}: the field 'vector' is required", f"{where}.vector")
    if "layers" not in spec and not isinstance(spec["vector"], str):
        raise InvalidField(
            f"{where}: the field 'layers' is required (only a registered vector made per layer, named, brings its own)",
            f"{where}.layers",
        )
    read = {"kind": kind, "positions": spec.get("positions", "all"), "layers": None}
    if spec.get("layers") == EVERYWHERE and kind == "ablate":
        read["layers"] = EVERYWHERE
    elif "layers" in spec:
        with naming(f"{where}.layers"):
            arguments.layer_indices(spec["layers"], num_layers, where)
            read["layers"] = spec["layers"]
    with naming(f"{where}.vector"):
        vector = spec["vector"]
        read["vector"] = vector if isinstance(vector, str) else checked_vector(vector, hidden_size, where)
        if (kind != "add" or spec.get("scale") == "relative") and not isinstance(vector, str):
            unit_direction(read["vector"], where)
    if kind == "add":
        read["factor"] = spec.get("factor", 1.0)
        with naming(f"{where}.factor"):
            arguments.finite_number(read["factor"], where)
        read["scale"] = _read_scale(spec, where, read["factor"], max_relative_dose)
    if kind == "cap":
        _read_bounds(spec, where, read)
    with naming(f"{where}.positions"):
        arguments.phase_or_positions(read["positions"], where)
    return {**read, "when": when}


def _read_scale(spec: dict[str, Any], where: str, factor: float, max_relative_dose: float | None) -> str:
    """An ``add`` spec's ``scale`` (`specs.SCALES`; ``"absolute"`` where it gives none), its factor within the
    server's ``--max-relative-dose`` where it is relative; `InvalidField` naming the field."""
    scale = spec.get("scale", "absolute")
    if not isinstance(scale, str) or scale not in SCALES:
        raise InvalidField(
            f"{where}: scale must be one of {', '.join(repr(name) for name in SCALES)} ('absolute': factor x vector; "
            f"'relative': factor x the stream's norm x the vector's direction), got {scale!r}",
            f"{where}.scale",
        )
    if scale == "relative" and max_relative_dose is not None and abs(factor) > max_relative_dose:
        raise InvalidField(
            f"{where}: a relative factor of {factor} moves the stream by {abs(factor):g} of its norm; this server "
            f"bounds relative factors to |factor| <= {max_relative_dose:g} (--max-relative-dose {max_relative_dose:g})",
            f"{where}.factor",
        )
    return scale


def _kind(spec: dict[str, Any], where: str) -> str:
    """A spec's ``kind`` (``"add"`` where it gives none), refusing an unknown one or a field of another kind."""
    kind = spec.get("kind", "add")
    if kind not in KINDS:
        known = ", ".join(repr(name) for name in KINDS)
        raise InvalidField(f"{where}: kind must be one of {known}, got {kind!r}", f"{where}.kind")
    beside = {"clamp": "'positions'", "patch": "'layers' and 'positions'"}.get(
        kind, "'layers', 'vector' and 'positions'"
    )
    for name in (*OWN_FIELDS, "layers", "vector"):
        if name in spec and name not in kind_fields(kind):
            has = " and ".join(repr(field) for field in KINDS[kind][1]) or "no field of its own"
            raise InvalidField(
                f"{where}: {kind!r} specs have no field {name!r} ({kind!r} takes {has} beside {beside})",
                f"{where}.{name}",
            )
    return kind


def _read_clamp(spec: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``clamp`` spec: a registered SAE's name, a feature index, exactly one of ``value`` and ``scale``
    (checked against the SAE by `with_vectors`)."""
    read = {"kind": "clamp", "positions": spec.get("positions", "all"), "layers": None, "vector": None}
    if not isinstance(spec.get("sae"), str):
        raise InvalidField(f"{where}: a 'clamp' spec names a registered SAE (--sae NAME=DIR) in 'sae'", f"{where}.sae")
    feature = spec.get("feature")
    if not isinstance(feature, int) or isinstance(feature, bool) or feature < 0:
        raise InvalidField(f"{where}: 'feature' must be an int >= 0, got {feature!r}", f"{where}.feature")
    given = [name for name in ("value", "scale") if spec.get(name) is not None]
    if len(given) != 1:
        raise InvalidField(f"{where}: a 'clamp' spec gives 'value' or 'scale', exactly one", where)
    with naming(f"{where}.{given[0]}"):
        arguments.finite_number(spec[given[0]], where, given[0])
    with naming(f"{where}.positions"):
        arguments.phase_or_positions(read["positions"], where)
    return {**read, "sae": spec["sae"], "feature": feature, given[0]: spec[given[0]]}


def _read_patch(spec: dict[str, Any], where: str, num_layers: int, hidden_size: int) -> dict[str, Any]:
    """A ``patch`` spec: ``layers``, a list of prompt ``positions``, ``vectors`` (one list of floats for every
    position, or a list of them, one per position) and optionally ``value`` (``layer_output`` unless told)."""
    for name in ("layers", "vectors", "positions"):
        if name not in spec:
            raise InvalidField(f"{where}: a 'patch' spec needs '{name}'", f"{where}.{name}")
    with naming(f"{where}.layers"):
        arguments.layer_indices(spec["layers"], num_layers, where)
    value = spec.get("value", "layer_output")
    if value not in PATCHED_VALUES:
        raise InvalidField(
            f"{where}: a 'patch' spec's value is one of {', '.join(PATCHED_VALUES)}, got {value!r}", f"{where}.value"
        )
    vectors = spec["vectors"]
    rows = vectors if isinstance(vectors, list) and vectors and isinstance(vectors[0], list) else [vectors]
    with naming(f"{where}.vectors"):
        checked = torch.stack([checked_vector(row, hidden_size, where) for row in rows])
        patch = Patch(checked if len(rows) > 1 else checked[0], spec["layers"], spec["positions"], value)
    return {"kind": "patch", "layers": spec["layers"], "vector": None, "positions": patch.positions, "patch": patch}


def _read_bounds(spec: dict[str, Any], where: str, read: dict[str, Any]) -> None:
    """A ``cap`` spec's ``min`` and ``max`` into ``read``: finite numbers, at least one, ``min <= max``."""
    for name in ("min", "max"):
        read[name] = spec.get(name)
        if read[name] is not None:
            with naming(f"{where}.{name}"):
                arguments.finite_number(read[name], where, name)
    if read["min"] is None and read["max"] is None:
        raise InvalidField(f"{where}: a 'cap' spec clamps the projection to 'min', 'max' or both: give one", where)
    if read["min"] is not None and read["max"] is not None and read["min"] > read["max"]:
        raise InvalidField(
            f"{where}: min must not exceed max, got min={read['min']} > max={read['max']}", f"{where}.min"
        )


def _spec(read: dict[str, Any], layers: Any, vector: torch.Tensor, saes: Mapping[str, SAE]) -> Steering | Cap:
    """The spec a read field of its kind makes, at ``layers`` with ``vector`` (its gate's SAE from ``saes``)."""
    when = gate_of(read["when"], saes)
    if read["kind"] == "add":
        return Steering(layers, vector, read["factor"], read["positions"], when, read["scale"])
    if read["kind"] == "ablate":
        return Ablate(vector, layers, read["positions"], when)
    return Cap(vector, layers, read["min"], read["max"], read["positions"], when)


def named_vectors(specs: Sequence[dict[str, Any]]) -> set[str]:
    """The registered vector names `read_steering`'s specs refer to."""
    return {spec["vector"] for spec in specs if isinstance(spec["vector"], str)}


def with_vectors(
    specs: Sequence[dict[str, Any]], registered: Mapping[str, Vector], saes: Mapping[str, SAE] | None = None
) -> list[Steering | Cap | Clamp]:
    """`read_steering`'s specs as `Steering`, `Ablate`, `Cap` or `Clamp` by their kind, each named vector taken
    from ``registered`` and each named SAE from ``saes`` (`InvalidField` if absent; a zero vector names no
    direction to ablate or cap, a feature must be one the SAE has).

    A vector registered per layer is applied at its own layers where the spec names none, else at the layers
    it names (each of which it must carry)."""
    steering = []
    for i, spec in enumerate(specs):
        if spec["kind"] == "clamp":
            steering.append(_clamp(spec, f"steering[{i}]", saes or {}))
            continue
        if spec["kind"] == "patch":
            steering.append(spec["patch"])
            continue
        vector, layers = spec["vector"], spec["layers"]
        if isinstance(vector, str):
            if vector not in registered:
                raise InvalidField(
                    f"steering[{i}]: no vector is registered as {vector!r} (GET /v1/steering/vectors lists them, "
                    "POST registers one), or give the vector as a list of floats",
                    f"steering[{i}].vector",
                )
            vector = registered[vector]
        if not isinstance(vector, dict):
            if layers is None:
                raise InvalidField(
                    f"steering[{i}]: {spec['vector']!r} is one vector, made for no layer: name the layers",
                    f"steering[{i}].layers",
                )
            with naming(f"steering[{i}].vector"):
                steering.append(_spec(spec, layers, vector, saes or {}))
            continue
        if layers == EVERYWHERE:
            raise InvalidField(
                f"steering[{i}]: {spec['vector']!r} is a vector per layer; layers 'all' ablates one vector at every "
                "location: name one of its layers' vectors, or register that vector alone",
                f"steering[{i}].layers",
            )
        chosen = sorted(vector) if layers is None else [layers] if isinstance(layers, int) else list(layers)
        missing = sorted(set(chosen) - set(vector))
        if missing:
            raise InvalidField(
                f"steering[{i}]: {spec['vector']!r} carries layers {sorted(vector)}, not {missing}; name some of "
                "them, or none to apply it at all of its own",
                f"steering[{i}].layers",
            )
        with naming(f"steering[{i}].vector"):
            steering += [_spec(spec, layer, vector[layer], saes or {}) for layer in chosen]
    return steering


def _clamp(spec: dict[str, Any], where: str, saes: Mapping[str, SAE]) -> Clamp:
    """A read ``clamp`` spec as a `Clamp` of the SAE it names."""
    sae = saes.get(spec["sae"])
    if sae is None:
        held = ", ".join(sorted(saes)) or "none (start the server with --sae NAME=DIR)"
        raise InvalidField(
            f"{where}: no SAE is registered as {spec['sae']!r}; this server holds {held}", f"{where}.sae"
        )
    if spec["feature"] >= sae.d_sae:
        raise InvalidField(
            f"{where}: SAE {spec['sae']!r} has {sae.d_sae} features (0..{sae.d_sae - 1}), not {spec['feature']}",
            f"{where}.feature",
        )
    with naming(f"{where}.when"):
        when = gate_of(spec["when"], saes)
    return Clamp(sae, spec["feature"], spec.get("value"), spec.get("scale"), spec["positions"], when)


def checked_vector(value: Any, hidden_size: int, what: str) -> torch.Tensor:
    """``value`` (a JSON list of numbers) as a finite float32 ``[hidden_size]`` tensor; raises ``ValueError``."""
    if not isinstance(value, list):
        raise ValueError(
            f"{what}: the vector is a list of {hidden_size} floats or a registered vector's name, "
            f"got {type(value).__name__}"
        )
    return arguments.hidden_vector(arguments.one_vector(value, what), hidden_size, what, rows=False)


def check_positions(specs: Sequence[Steering | Cap], prompt_length: int, prompt: str = "the prompt") -> None:
    """Refuse a spec listing a position outside a prompt of ``prompt_length`` tokens (`InvalidField`)."""
    for i, spec in enumerate(specs):
        if not isinstance(spec.positions, str):
            with naming(f"steering[{i}].positions"):
                arguments.positions_within(spec.positions, prompt_length, f"steering[{i}] ({prompt})")


def read_when(when: Any, where: str, hidden_size: int) -> dict[str, Any]:
    """A spec's ``when``: ``{"probe": {...}, "op", "threshold"}`` or ``{"sae": NAME, "feature", "op", "threshold"}``
    (the SAE resolved by `gate_of`); `InvalidField` naming the field."""
    if not isinstance(when, dict) or not ({"probe", "sae"} & set(when)):
        raise InvalidField(
            f"{where}: a gate is {{'probe': {{...}}, 'op', 'threshold'}} or {{'sae', 'feature', 'op', 'threshold'}}",
            where,
        )
    allowed = ("probe", "op", "threshold") if "probe" in when else ("sae", "feature", "op", "threshold")
    for name in when:
        if name not in allowed:
            raise InvalidField(f"{where}: a gate takes {', '.join(allowed)}, not {name!r}", f"{where}.{name}")
    if when.get("op") not in OPERATORS:
        raise InvalidField(f"{where}: op is one of {', '.join(OPERATORS)}, got {when.get('op')!r}", f"{where}.op")
    with naming(f"{where}.threshold"):
        arguments.finite_number(when.get("threshold"), where, "threshold")
    if "probe" in when:
        return {**when, "probe": read_probe(when["probe"], f"{where}.probe", hidden_size)}
    return dict(when)


def gate_of(when: dict[str, Any] | None, saes: Mapping[str, SAE]) -> tuple | None:
    """A read ``when`` as a spec's ``when`` tuple, its SAE taken from ``saes`` by name; `InvalidField`."""
    if when is None:
        return None
    if "probe" in when:
        return (when["probe"], when["op"], when["threshold"])
    sae = saes.get(when["sae"])
    if sae is None:
        held = ", ".join(sorted(saes)) or "none (start the server with --sae NAME=DIR)"
        raise InvalidField(f"when: no SAE is registered as {when['sae']!r}; this server holds {held}", "when.sae")
    return (sae, when.get("feature"), when["op"], when["threshold"])
