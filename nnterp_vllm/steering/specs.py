"""The specs: declarative steering, checked on the client, carried per request into the engine.

`Steering` says what `Standardized.steer` says (a vector added to the residual stream leaving some
standardized blocks, times a factor); `Cap` what `Standardized.cap` says (the stream's projection on a
direction clamped to a range) and `Ablate` what `Standardized.ablate` says (that projection set to zero). Each
says *when* too, so one request can carry it through a whole generation: ``positions="all"`` (every token,
prompt and generated), ``"prompt"``, ``"generated"`` (each generated token, when it is fed back in), or a list of
prompt positions (negative counting from the prompt's end). A request may carry several specs. At one block the
added vectors come first, then each cap or ablation in the order the request lists them.

The spec is checked twice, with the errors `steer` raises: what needs no model when it is made
(types, dtype, finiteness, the position form), the rest against the engine's model and the rendered
prompt (vector width, layer range, positions inside the prompt) before the request is sent.
What travels to the engine is `request_steering`'s plain form (lists and numbers, so vLLM's
serializer carries it in ``SamplingParams.extra_args``); `token_sets` reads it on both sides.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import arguments

WHAT = "Steering"
#: ``layers`` of an `Ablate` at every residual-stream location.
EVERYWHERE = "all"
#: The values whose every location an `Ablate` at `EVERYWHERE` clears: the stream entering the first block, and
#: what each block's attention and MLP add to it.
EVERYWHERE_VALUES = ("layers.0.layer_input", "layers.*.attention_output", "layers.*.mlp_output")
#: The values a steered engine can act at: each block's output (where `Steering`, `Cap` and `Clamp` act), what its
#: attention and MLP add (a `Patch` there, an `Ablate` everywhere), the stream entering the first block (an `Ablate`
#: everywhere). An engine built with fewer (``steering_values=``) runs the steering operation at fewer places.
STEERING_VALUES = ("layer_output", "attention_output", "mlp_output", "layer_input")
#: Caps, ablations and clamps one token may have applied at one block (the engine's direction slots per table row),
#: unless the engine is built with another number (``SteeredVLLM(..., steering_directions_per_block=N)``).
DIRECTIONS_PER_BLOCK = 2
#: What a `Steering`'s factor is measured against: ``"absolute"`` (the vector's own size) or ``"relative"`` (the
#: residual stream's norm at that block and token).
SCALES = ("absolute", "relative")
#: The key of ``SamplingParams.extra_args`` under which a request's steering travels to the engine.
EXTRA_ARGS_KEY = "nnterp_vllm_steering"
#: The key of a request's steering (engine form) naming the first prompt position it changes and the salt its
#: prefix-cache blocks take from the block holding that position on (`request_steering`).
SALTED_FROM = "salted_from"


class Placed:
    """What every spec can be asked for: itself at other positions."""

    def at_positions(self, positions: str | Sequence[int]) -> Placed:
        """This spec acting at ``positions`` (as `Steering` takes them) instead of its own."""
        return replace(self, positions=positions)


@dataclass(frozen=True, eq=False)
class Steering(Placed):
    """Add ``factor * vector`` to the residual stream leaving ``layers``, at ``positions``; with
    ``scale="relative"``, ``factor * |h| * vector / |vector|`` instead (``h`` that stream at that token).

    Args:
        layers: A standardized block index or a list of them (``layers=10`` is ``model.layers[10]``;
            negative counts from the last block).
        vector: A ``[hidden_size]`` tensor or a list of floats (not zero where ``scale="relative"``: only its
            direction counts there).
        factor: A finite number the vector is multiplied by.
        positions: ``"all"`` (default: prompt and generated tokens), ``"prompt"``, ``"generated"``, or
            a list of prompt positions (negative counting from the prompt's end).
        when: ``None`` (every token at ``positions``), or a gate: ``(Probe, op, threshold)`` or ``(sae, feature, op,
            threshold)`` (`steering.probes.gate`), read at a block at or before this spec's, per token; the spec acts
            only on the tokens whose read passes.
        scale: What ``factor`` is measured against. ``"absolute"`` (default): the vector as given, ``h + factor *
            vector``. ``"relative"``: the residual stream's own norm at that block and token, ``h + factor * |h| *
            vector / |vector|``, ``h`` the stream leaving the block before any spec there edits it and ``|h|`` its
            L2 norm over the hidden dimension, computed in float32: ``factor=0.1`` moves each token's stream by a
            tenth of its length along the vector's direction, at any block of any model.

    The checks that need no model run here; the vector's width, the layer range and the positions
    against the prompt are checked when a request carrying the spec is made.
    """

    layers: int | Sequence[int]
    vector: torch.Tensor | Sequence[float] = field(repr=False)
    factor: float = 1.0
    positions: str | Sequence[int] = "all"
    when: Any = field(default=None, repr=False)
    scale: str = "absolute"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", arguments.layer_list(self.layers, WHAT))
        object.__setattr__(self, "vector", arguments.one_vector(self.vector, WHAT).detach())
        object.__setattr__(self, "factor", arguments.finite_number(self.factor, WHAT))
        object.__setattr__(self, "positions", arguments.phase_or_positions(self.positions, WHAT))
        check_when(self.when, WHAT)
        check_scale(self.scale, WHAT)
        if self.scale == "relative":
            unit_direction(self.vector, f"{WHAT} (scale='relative')")

    def resolved(self, num_layers: int, hidden_size: int, prompt_length: int) -> dict[str, Any]:
        """This spec in its engine form for a prompt of ``prompt_length`` tokens on a model of ``num_layers``
        blocks of width ``hidden_size``: sorted layer indices, the vector as float32 numbers, the factor, the
        phase or sorted absolute prompt positions; a relative spec's vector its unit direction (normalised in
        float64), beside ``"scale": "relative"`` (an absolute spec's form names no scale). Raises `ValueError` as
        `steer` does."""
        if self.scale != "relative":
            return {**_resolved(self, num_layers, hidden_size, prompt_length), "kind": "add", "factor": self.factor}
        unit = relative_direction(self.vector)
        entry = _resolved(self, num_layers, hidden_size, prompt_length, unit)
        return {**entry, "kind": "add", "factor": self.factor, "scale": "relative"}

    def scaled(self, factor: float) -> Steering:
        """This spec with its factor times ``factor`` (its scale kept)."""
        return replace(self, factor=self.factor * factor)


@dataclass(frozen=True, eq=False)
class Cap(Placed):
    """Clamp the residual stream's projection on the direction ``vector`` (unit-normalised here) to
    ``[min, max]`` where it leaves ``layers``, at ``positions``: the stream ``h`` becomes
    ``h + (clamp(h . u, min, max) - h . u) * u``. Either bound may be left out (``None``), not both.

    Args:
        vector: A ``[hidden_size]`` tensor or a list of floats, not zero; only its direction counts.
        layers: A standardized block index or a list of them (negative counts from the last block).
        min: The lowest projection kept, or ``None``.
        max: The highest projection kept, or ``None``.
        positions: As `Steering` takes them.
        when: As `Steering` takes it.
    """

    vector: torch.Tensor | Sequence[float] = field(repr=False)
    layers: int | Sequence[int] = field(default=None)  # type: ignore[assignment]
    min: float | None = None
    max: float | None = None
    positions: str | Sequence[int] = "all"
    when: Any = field(default=None, repr=False)
    what = "Cap"

    def __post_init__(self) -> None:
        what = self.what
        if self.layers is None:
            raise ValueError(f"{what}: name the blocks whose output it acts on, e.g. {what}(vector, layers=[8, 9])")
        if self.layers == EVERYWHERE and what != "Ablate":
            raise ValueError(
                f"{what}: layers={EVERYWHERE!r} is served by Ablate only (every residual-stream location); name the "
                f"blocks whose output it caps, e.g. {what}(vector, layers=[8, 9], max=...)"
            )
        if self.layers != EVERYWHERE:
            object.__setattr__(self, "layers", arguments.layer_list(self.layers, what))
        object.__setattr__(self, "vector", unit_direction(self.vector, what))
        bounds = [
            None if bound is None else arguments.finite_number(bound, what, name)
            for name, bound in (("min", self.min), ("max", self.max))
        ]
        if bounds == [None, None]:
            raise ValueError(f"{what}: give min, max or both: the range the projection is clamped to")
        if None not in bounds and bounds[0] > bounds[1]:
            raise ValueError(f"{what}: min must not exceed max, got min={bounds[0]} > max={bounds[1]}")
        object.__setattr__(self, "min", bounds[0])
        object.__setattr__(self, "max", bounds[1])
        object.__setattr__(self, "positions", arguments.phase_or_positions(self.positions, what))
        check_when(self.when, what)
        if self.when is not None and self.layers == EVERYWHERE:
            raise ValueError(
                f"{what}: layers={EVERYWHERE!r} acts on the stream entering the first block, before any block a gate "
                "could read: name the blocks it acts on to gate it"
            )

    def resolved(self, num_layers: int, hidden_size: int, prompt_length: int) -> dict[str, Any]:
        """This spec in its engine form (as `Steering.resolved`): the unit direction and its bounds."""
        entry = _resolved(self, num_layers, hidden_size, prompt_length)
        return {**entry, "kind": "cap", "min": self.min, "max": self.max}

    def scaled(self, factor: float) -> Cap:
        """This cap with both bounds times ``factor`` (a negative factor swaps them)."""
        low, high = (None if bound is None else bound * factor for bound in (self.min, self.max))
        return replace(self, min=high, max=low) if factor < 0 else replace(self, min=low, max=high)


class Ablate(Cap):
    """Remove the direction ``vector`` (unit-normalised here) from the residual stream, at ``positions``: the
    stream ``h`` becomes ``h - (h . u) * u``, its projection on ``u`` zero (a `Cap` to ``[0, 0]``).

    Args:
        vector: A ``[hidden_size]`` tensor or a list of floats, not zero; only its direction counts.
        layers: ``"all"`` (default): every residual-stream location, so the stream never carries the direction:
            the stream entering the first block (the embeddings, with whatever the family adds to them there)
            and what every block's attention and MLP add to it (the stream is their sum, so every block's input,
            its MLP's input and its output hold none of it either). Or a standardized block index or a list of
            them: the stream leaving those blocks only, where `Steering` adds.
        positions: As `Steering` takes them.
        when: As `Steering` takes it (with block indices only).
    """

    what = "Ablate"

    def __init__(
        self,
        vector: torch.Tensor | Sequence[float],
        layers: int | Sequence[int] | str = EVERYWHERE,
        positions: str | Sequence[int] = "all",
        when: Any = None,
    ) -> None:
        super().__init__(vector, layers, 0.0, 0.0, positions, when)

    def __repr__(self) -> str:
        return f"Ablate(layers={self.layers!r}, positions={self.positions!r})"

    def at_positions(self, positions: str | Sequence[int]) -> Ablate:
        """This ablation at ``positions`` instead of its own."""
        return Ablate(self.vector, self.layers, positions, self.when)

    def scaled(self, factor: float) -> Ablate:
        """This ablation: it removes the whole direction whatever the factor."""
        return self


@dataclass(frozen=True, eq=False)
class Clamp(Placed):
    """Set feature ``feature`` of the SAE ``sae`` to ``value`` (or scale it by ``scale``) where the stream the SAE
    reads leaves its block, at ``positions``: the stream ``h`` becomes ``h + (target - f(h)) * d``, ``f(h)`` the
    feature's activation by the SAE's own encoder (ReLU, JumpReLU or TopK, as SAELens computes it), ``d`` its
    decoder row and ``target`` ``value`` or ``scale * f(h)``. Where the SAE reconstructs ``h`` exactly its
    re-encoding reads ``target`` back; otherwise up to what the decoder row also moves in the other features.

    Args:
        sae: A loaded `SAE` or the path of a SAELens SAE directory (loaded here). A TopK SAE's feature depends on
            all of them, so the engine it runs on must hold that SAE (``saes=[...]``).
        feature: The feature's index, ``0 <= feature < d_sae``.
        value: The activation it is set to (a finite number), or
        scale: the factor its activation is multiplied by; give exactly one.
        positions: As `Steering` takes them.
        when: As `Steering` takes it.
    """

    sae: Any = field(repr=False)
    feature: int = 0
    value: float | None = None
    scale: float | None = None
    positions: str | Sequence[int] = "all"
    when: Any = field(default=None, repr=False)
    what = "Clamp"

    def __post_init__(self) -> None:
        from .saes import as_sae

        what = self.what
        sae = as_sae(self.sae, what)
        object.__setattr__(self, "sae", sae)
        feature = self.feature
        if not isinstance(feature, int) or isinstance(feature, bool) or not 0 <= feature < sae.d_sae:
            raise ValueError(f"{what}: feature must be an int in 0..{sae.d_sae - 1} (the SAE's d_sae), got {feature!r}")
        if (self.value is None) == (self.scale is None):
            raise ValueError(f"{what}: give value= (the activation the feature is set to) or scale=, exactly one")
        for name in ("value", "scale"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, arguments.finite_number(getattr(self, name), what, name))
        object.__setattr__(self, "positions", arguments.phase_or_positions(self.positions, what))
        check_when(self.when, what)

    @property
    def layers(self) -> list[int]:
        """The block whose output the SAE reads, as a one-block list."""
        return [self.sae.layer]

    @property
    def bounds(self) -> tuple[float | None, float | None]:
        """The range the feature's (scaled) activation is clamped to: ``(value, value)``, or unbounded."""
        return (self.value, self.value) if self.value is not None else (None, None)

    def resolved(self, num_layers: int, hidden_size: int, prompt_length: int) -> dict[str, Any]:
        """This spec in its engine form (as `Steering.resolved`): the feature's encoder direction, offset and
        threshold, its decoder row, the target's bounds and scale; a TopK SAE's feature by its index and the
        SAE's digest (the engine computes it from all of them)."""
        sae = self.sae
        what = self.what
        if sae.layer >= num_layers or sae.d_in != hidden_size:
            raise ValueError(
                f"{what}: {sae.path} reads block {sae.layer}'s output, {sae.d_in} wide; this model has {num_layers} "
                f"blocks, {hidden_size} wide"
            )
        read, offset, threshold = sae.feature_encoder(self.feature)
        entry = _resolved(self, num_layers, hidden_size, prompt_length, read)
        low, high = self.bounds
        topk = {"feature": self.feature, "sae": sae.digest} if sae.architecture == "topk" else None
        return {
            **entry,
            "kind": "clamp",
            "write": sae.decoder_rows()[self.feature].tolist(),
            "offset": offset,
            "threshold": threshold,
            "scale": 1.0 if self.scale is None else self.scale,
            "min": low,
            "max": high,
            "topk": topk,
        }

    def scaled(self, factor: float) -> Clamp:
        """This clamp with its value (or its scale) times ``factor``."""
        if self.value is not None:
            return replace(self, value=self.value * factor)
        return replace(self, scale=self.scale * factor)


#: The standardized values a `Patch` sets: the stream a block hands on, and what its attention and its MLP add to it.
PATCHED_VALUES = ("layer_output", "attention_output", "mlp_output")


@dataclass(frozen=True, eq=False)
class Patch(Placed):
    """Set ``value`` of the blocks ``layers`` to ``vectors`` at the prompt ``positions``: ``h' = v`` there, untouched
    elsewhere (activation patching: rows a clean run kept, set into a corrupted run).

    Args:
        vectors: One ``[hidden_size]`` vector for every position, or ``[len(positions), hidden_size]``: a row per
            position, in the order given (a tensor, or lists of floats).
        layers: A standardized block index or a list of them (the same rows are set at each).
        positions: A non-empty list of prompt positions (negative counting from the prompt's end), each once.
        value: ``"layer_output"`` (default: the stream leaving the block), ``"attention_output"`` or ``"mlp_output"``
            (what the block's attention or MLP adds to the stream).

    The checks that need no model run here; the vectors' width, the layer range and the positions against the
    prompt are checked when a request carrying the spec is made.
    """

    vectors: Any = field(repr=False)
    layers: int | Sequence[int] = field(default=None)  # type: ignore[assignment]
    positions: Sequence[int] = field(default=None)  # type: ignore[assignment]
    value: str = "layer_output"
    what = "Patch"

    def __post_init__(self) -> None:
        what = self.what
        if self.layers is None or self.positions is None:
            raise ValueError(
                f"{what}: name the blocks and the prompt positions, e.g. {what}(rows, layers=8, positions=[3])"
            )
        object.__setattr__(self, "layers", arguments.layer_list(self.layers, what))
        positions = arguments.listed_ints(self.positions)
        if positions is None:
            raise ValueError(
                f"{what}: positions must be a non-empty list of prompt positions (ints, negative counting from the "
                f"prompt's end), got {self.positions!r}"
            )
        if len(set(positions)) != len(positions):
            raise ValueError(f"{what}: each position is set once; {positions} names one twice")
        object.__setattr__(self, "positions", positions)
        if self.value not in PATCHED_VALUES:
            raise ValueError(f"{what}: value must be one of {', '.join(PATCHED_VALUES)}, got {self.value!r}")
        vectors = self.vectors
        if isinstance(vectors, (list, tuple)) and vectors and isinstance(vectors[0], (list, tuple)):
            vectors = torch.stack([arguments.one_vector(row, what) for row in vectors])
        elif not isinstance(vectors, torch.Tensor) or vectors.dim() == 1:
            vectors = arguments.one_vector(vectors, what)
        else:
            arguments.hidden_vector(vectors, vectors.shape[-1], what)
        if vectors.dim() == 2 and vectors.shape[0] != len(positions):
            raise ValueError(
                f"{what}: vectors has {vectors.shape[0]} rows for {len(positions)} positions: give one row per "
                "position, or one [hidden_size] vector for all of them"
            )
        object.__setattr__(self, "vectors", vectors.detach())

    def rows(self) -> torch.Tensor:
        """``[len(positions), hidden]``: the vector each position is set to, in the order of ``positions``."""
        return self.vectors.expand(len(self.positions), -1) if self.vectors.dim() == 1 else self.vectors

    def resolved(self, num_layers: int, hidden_size: int, prompt_length: int) -> list[dict[str, Any]]:
        """This spec in its engine form for a prompt of ``prompt_length`` tokens: one entry per position (each its
        own row of the engine's steering pool), as `Steering.resolved` makes them, the value named. Raises
        `ValueError` as `steer` does."""
        what = self.what
        layers = arguments.layer_indices(self.layers, num_layers, what)
        rows = arguments.hidden_vector(self.rows(), hidden_size, what)
        positions = arguments.positions_within(self.positions, prompt_length, what)
        if len(set(positions)) != len(positions):
            raise ValueError(
                f"{what}: positions {self.positions} name one position of the {prompt_length}-token prompt twice"
            )
        return [
            {
                "kind": "patch",
                "layers": layers,
                "value": self.value,
                "vector": row.to(device="cpu", dtype=torch.float32).tolist(),
                "positions": [position],
            }
            for position, row in zip(positions, rows)
        ]

    def scaled(self, factor: float) -> Patch:
        """This patch: it sets its rows whatever the factor."""
        return self


#: The specs a request may carry.
SPECS = (Steering, Cap, Clamp, Patch)
#: Each kind of spec by the name a server request or a grid file gives it: the spec and the fields of its own it
#: takes (beside ``positions``, and a direction's ``layers`` and ``vector``, which every kind but a clamp takes).
KINDS: dict[str, tuple[type, tuple[str, ...]]] = {
    "add": (Steering, ("factor", "scale")),
    "ablate": (Ablate, ()),
    "cap": (Cap, ("min", "max")),
    "clamp": (Clamp, ("sae", "feature", "value", "scale")),
    "patch": (Patch, ("vectors", "value")),
}


def kind_fields(kind: str) -> tuple[str, ...]:
    """The fields a spec of ``kind`` (`KINDS`) takes beside ``positions``: a direction's ``vector`` and ``layers``
    (but a clamp's direction is its SAE feature's) and its own."""
    own = KINDS[kind][1]
    if kind == "clamp":
        return own
    return ("layers", *own) if kind == "patch" else ("vector", "layers", *own)


def feature_change(
    stream: torch.Tensor,
    read: torch.Tensor,
    write: torch.Tensor,
    low: Any = None,
    high: Any = None,
    *,
    offset: Any = 0.0,
    threshold: Any = None,
    scale: Any = 1.0,
    pre: torch.Tensor | None = None,
    floor: Any = None,
) -> torch.Tensor:
    """What to add to ``stream`` (``[..., hidden]``) to move its activation along ``read`` to its target, along
    ``write``: the activation ``a`` is ``pre = stream . read + offset`` (or ``pre`` as given), zero unless ``pre >
    threshold`` and ``pre >= floor``; the target is ``clamp(scale * a, low, high)``; the change ``(target - a) *
    write``. A cap is ``read = write = u`` with no threshold; an SAE feature's clamp reads its encoder's column and
    writes its decoder row. Every argument after ``write`` is a number, ``None`` (no bound) or a tensor of the
    stream's leading shape. In the stream's dtype, computed in float32; pure tensor code."""
    if pre is None:
        pre = (stream.float() * read.float()).sum(-1) + offset
    active = pre
    if threshold is not None:
        active = torch.where(pre > threshold, pre, torch.zeros_like(pre))
    if floor is not None:
        active = torch.where(pre >= floor, active, torch.zeros_like(active))
    target = active * scale
    if low is not None or high is not None:
        target = target.clamp(low, high)
    return ((target - active).unsqueeze(-1) * write.float()).to(stream.dtype)


def projection_change(stream: torch.Tensor, direction: torch.Tensor, low: Any, high: Any) -> torch.Tensor:
    """What to add to ``stream`` (``[..., hidden]``) so that its projection on the unit ``direction`` lies in
    ``[low, high]`` (`feature_change` reading and writing along the direction)."""
    return feature_change(stream, direction, direction, low, high)


def relative_direction(vector: torch.Tensor) -> torch.Tensor:
    """The unit direction a relative `Steering` adds along (``[hidden]`` or ``[n, hidden]``, a unit row each):
    ``vector / |vector|`` computed in float64, as float32. The engine form holds it, and ``steer`` adds the same."""
    vector = vector.detach().double()
    return (vector / vector.norm(dim=-1, keepdim=True)).float()


def relative_addition(unit: torch.Tensor, factor: Any, unsteered: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a relative `Steering` adds to a stream whose value before any edit at its block is ``unsteered``
    (``[..., hidden]``): ``factor * |unsteered| * unit``, the norm over the hidden dimension, all in float32 (the
    factor times the unit direction first, as the engine's pool entry holds it), in ``dtype``."""
    norm = torch.linalg.vector_norm(unsteered, dim=-1, keepdim=True, dtype=torch.float32)
    return ((factor * unit.to(device=unsteered.device, dtype=torch.float32)) * norm).to(dtype)


def check_scale(scale: Any, what: str) -> None:
    """Refuse a ``scale`` that is not one of `SCALES` (``ValueError`` naming what is allowed)."""
    if not isinstance(scale, str) or scale not in SCALES:
        raise ValueError(
            f"{what}: scale must be 'absolute' (factor x vector) or 'relative' (factor x the stream's norm x the "
            f"vector's direction), got {scale!r}"
        )


def is_relative(entry: dict[str, Any]) -> bool:
    """Whether a spec in engine form adds a fraction of the stream's norm (a relative `Steering`)."""
    return entry.get("scale") == "relative"


def unit_direction(vector: Any, what: str) -> torch.Tensor:
    """``vector`` (as `arguments.one_vector` takes it) divided by its norm; a zero vector names no direction."""
    vector = arguments.one_vector(vector, what).detach()
    norm = vector.double().norm()
    if not norm > 0 or not torch.isfinite(norm):
        raise ValueError(f"{what}: the vector must have a nonzero, finite norm to name a direction, got {float(norm)}")
    return (vector.double() / norm).to(vector.dtype)


def _resolved(
    spec: Any, num_layers: int, hidden_size: int, prompt_length: int, vector: torch.Tensor | None = None
) -> dict[str, Any]:
    """What every spec's engine form holds: sorted layer indices, the vector (the spec's own unless given) as
    float32 numbers, the phase or sorted absolute prompt positions. Raises `ValueError` as `steer` does."""
    what = getattr(spec, "what", WHAT)
    layers = EVERYWHERE if spec.layers == EVERYWHERE else arguments.layer_indices(spec.layers, num_layers, what)
    vector = arguments.hidden_vector(spec.vector if vector is None else vector, hidden_size, what, rows=False)
    positions = spec.positions
    if not isinstance(positions, str):
        positions = sorted(set(arguments.positions_within(positions, prompt_length, what)))
    resolved = {
        "layers": layers,
        "vector": vector.to(device="cpu", dtype=torch.float32).tolist(),
        "positions": positions,
    }
    when = getattr(spec, "when", None)
    if when is not None:
        resolved["when"] = gate_before(when, layers, num_layers, hidden_size, what)
    return resolved


def gate_before(when: Any, layers: Sequence[int], num_layers: int, hidden_size: int, what: str) -> dict[str, Any]:
    """A spec's ``when`` in engine form (`probes.gate`) for a spec acting at the blocks ``layers`` (indices); a gate
    reading a block after any of them is refused with a ``ValueError`` naming both."""
    from .probes import gate

    read = gate(when, num_layers, hidden_size, what)
    later = [layer for layer in layers if layer < read["layer"]]
    if later:
        raise ValueError(
            f"{what}: when reads block {read['layer']}'s output, after blocks {later} the spec acts on: a gate is "
            "read at a block at or before the spec's"
        )
    return read


def specs_of(steering: Any, where: str = "steering") -> list[Steering | Cap]:
    """One request's steering (``None``, a spec, or a list of them) as a list of specs (`Steering`, `Cap`,
    `Ablate`).

    A wrong type raises ``TypeError`` naming ``where`` (and the bad element's index in a list).
    """
    if steering is None:
        return []
    if isinstance(steering, SPECS):
        return [steering]
    if isinstance(steering, (list, tuple)):
        for index, spec in enumerate(steering):
            if not isinstance(spec, SPECS):
                raise TypeError(
                    f"{WHAT}: {where}[{index}] is a {type(spec).__name__}; a request's steering is None, a Steering "
                    "(or Cap, Ablate, Clamp, Patch) or a list of them"
                )
        return list(steering)
    raise TypeError(
        f"{WHAT}: {where} is a {type(steering).__name__}; a request's steering is None, a Steering (or Cap, Ablate, "
        "Clamp, Patch) or a list of them"
    )


def per_prompt(steering: Any, count: int) -> list[list[Steering | Cap]]:
    """``steering`` as given to ``generate`` for ``count`` prompts: one list of specs per prompt.

    A list as long as the prompts holds one entry per prompt (``None``, a spec or a list of them);
    anything else (``None``, one spec, a list of specs of another length) is for every prompt.
    A list of another length holding anything but specs fits neither reading: ``TypeError`` naming both.
    """
    if isinstance(steering, (list, tuple)) and len(steering) == count:
        return [specs_of(entry, f"steering[{index}]") for index, entry in enumerate(steering)]
    if isinstance(steering, (list, tuple)) and not all(isinstance(spec, SPECS) for spec in steering):
        raise TypeError(
            f"{WHAT}: steering is a list of {len(steering)} entries for {count} prompt(s), not all of them specs. "
            f"Give one entry per prompt (a list of {count}, each None, a Steering (or Cap, Ablate, Clamp, Patch) or a "
            "list of them), or one spec or a list of specs (of any length) that steers every prompt with all of them"
        )
    return [specs_of(steering)] * count


def request_steering(
    specs: Sequence[Steering],
    num_layers: int,
    hidden_size: int,
    prompt_length: int,
    dtype: torch.dtype = torch.float32,
    directions_per_block: int = DIRECTIONS_PER_BLOCK,
) -> tuple[dict[str, Any], str | None] | None:
    """A request's steering in engine form and the cache salt keying its prefix-cache blocks; ``None`` unsteered.

    The engine form is ``{"prompt_tokens": n, "specs": [...], "digests": [...]}``, a digest per spec
    (its kind, layers, vector and factor or bounds: specs with the same digest do the same thing). The salt digests
    all of it, the prompt's length included where a phase depends on it, so two requests share cached
    blocks only when every token of the shared prefix was steered alike. Steering of generated tokens
    only (`decode_only`) leaves the prompt's KV as an unsteered request computes it: no salt, so its
    prompt blocks are shared (and the engine caches none of its generated ones). Steering that acts on listed
    prompt positions only, the first of them ``p > 0``, leaves every token before ``p`` as an unsteered request
    computes it: the engine form then carries the salt and ``p`` (`SALTED_FROM`), no cache salt is returned, and
    the engine's scheduler salts the prompt's blocks from the one holding ``p`` on, so the blocks before it are
    shared with unsteered requests and any other steered from ``p`` or later. Steering a model computing in
    ``dtype`` could not hold (`check_held`), or more directions on one token at one block than the engine's
    ``directions_per_block`` (`check_directions`), is refused.
    """
    if not specs:
        return None
    resolved = [entry for spec in specs for entry in listed(spec.resolved(num_layers, hidden_size, prompt_length))]
    check_held(resolved, dtype)
    check_patches(resolved)
    digests = [_digest(entry) for entry in resolved]
    steering = {"prompt_tokens": prompt_length, "specs": resolved, "digests": digests}
    check_directions(resolved, token_sets(steering), directions_per_block)
    phases = [entry["positions"] for entry in resolved]
    if decode_only(steering):
        return steering, None
    length = prompt_length if any(phase in ("prompt", "generated") for phase in phases) else None
    salt = f"nnterp_vllm-steering-{hashlib.sha256(json.dumps([digests, phases, length]).encode()).hexdigest()}"
    first = min((min(phase) for phase in phases if not isinstance(phase, str)), default=0)
    if first > 0 and all(not isinstance(phase, str) or phase == "generated" for phase in phases):
        steering[SALTED_FROM] = [first, salt]
        return steering, None
    return steering, salt


def listed(resolved: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A spec's engine form as a list of entries (a `Patch` makes one per position)."""
    return resolved if isinstance(resolved, list) else [resolved]


#: The kinds of spec that move the stream along a direction (each takes a direction slot of the engine's pool entry).
DIRECTION_KINDS = ("cap", "clamp")


def takes_direction(entry: dict[str, Any]) -> bool:
    """Whether a spec in engine form takes a direction slot whatever acts beside it: a cap or clamp, or a gated
    addition (which moves the stream by its vector only where its gate passes)."""
    return entry["kind"] in DIRECTION_KINDS or entry.get("when") is not None


def slotted(entries: Sequence[dict[str, Any]]) -> list[bool]:
    """Which of the specs (engine form) one pool entry applies at one location take a direction slot: those that
    `takes_direction`, and the ungated relative additions where an ungated absolute addition or a patch acts there
    too. The entry's own added vector is then the absolute ones' sum (or the patch), else the relative ones' sum,
    times the stream's norm: one vector, one scale."""
    first = [entry["kind"] in ("add", "patch") and not takes_direction(entry) for entry in entries]
    mixed = any(own and not is_relative(entry) for own, entry in zip(first, entries))
    return [not own or (mixed and is_relative(entry)) for own, entry in zip(first, entries)]


def check_when(when: Any, what: str) -> None:
    """Refuse a ``when`` of the wrong form as the spec is made (the read itself is checked against the model)."""
    from .probes import OPERATORS

    if when is None:
        return
    if not isinstance(when, tuple) or len(when) not in (3, 4) or when[-2] not in OPERATORS:
        raise ValueError(
            f"{what}: when is (Probe, op, threshold) or (sae, feature, op, threshold), op one of "
            f"{', '.join(OPERATORS)}, got {when!r}"
        )


def check_patches(resolved: Sequence[dict[str, Any]]) -> None:
    """Refuse two patch entries that set the same value of the same block at the same position; ``ValueError``."""
    seen: dict[tuple, int] = {}
    for i, entry in enumerate(resolved):
        if entry["kind"] != "patch":
            continue
        for layer in entry["layers"]:
            key = (entry["value"], layer, entry["positions"][0])
            if key in seen:
                raise ValueError(
                    f"Patch: specs {[seen[key], i]} both set layers.{layer}.{entry['value']} at position {key[2]}; "
                    "a value is set once per position"
                )
            seen[key] = i


def decode_only(steering: dict[str, Any]) -> bool:
    """Whether a request's steering (engine form) acts on generated tokens only, none of its prompt."""
    return all(spec["positions"] == "generated" for spec in steering["specs"])


#: The vector added at a layer may reach at most the model dtype's largest finite value over this.
HEADROOM = 16


def held_bound(dtype: torch.dtype) -> float:
    """The largest magnitude an element of the vector added at one layer may have in a model computing in
    ``dtype``: its largest finite value over `HEADROOM`, so the stream it is added to keeps room to grow."""
    return torch.finfo(dtype).max / HEADROOM


def check_held(resolved: Sequence[dict[str, Any]], dtype: torch.dtype) -> None:
    """Refuse specs in engine form (`Steering.resolved`) whose added vector at some layer (``factor * vector``
    summed over the specs at that layer) has an element above `held_bound` of ``dtype``; ``ValueError``. A relative
    addition is left out: its size is a fraction of the stream's own norm, which only the engine knows."""
    bound = held_bound(dtype)
    added: dict[int, torch.Tensor] = {}
    adders: dict[int, list[int]] = {}
    for i, entry in enumerate(resolved):
        if entry["kind"] not in ("add", "patch") or is_relative(entry):
            continue
        scaled = torch.tensor(entry["vector"], dtype=torch.float64) * entry.get("factor", 1.0)
        for layer in entry["layers"]:
            added[layer] = added[layer] + scaled if layer in added else scaled
            adders.setdefault(layer, []).append(i)
    for layer in sorted(added):
        magnitude = added[layer].abs().nan_to_num(nan=math.inf)
        element = int(magnitude.argmax())
        if magnitude[element] > bound:
            held = str(dtype).removeprefix("torch.")
            raise ValueError(
                f"{WHAT}: at layer {layer} the added vector (factor x vector, summed over spec(s) {adders[layer]}) "
                f"reaches {float(added[layer][element]):.3g} at element {element}; a model computing in {held} holds "
                f"it with room to spare only within +-{bound:.3g} ({held}'s largest finite value "
                f"{torch.finfo(dtype).max:.3g} / {HEADROOM}): lower the factor or the vector"
            )


def check_directions(
    resolved: Sequence[dict[str, Any]], sets: TokenSets, directions_per_block: int = DIRECTIONS_PER_BLOCK
) -> None:
    """Refuse specs in engine form that would cap, ablate or clamp more than ``directions_per_block`` directions on
    one token at one block (the engine's direction slots per row); ``ValueError`` naming the block and the specs."""
    for indices in {tokens for tokens in (sets.prompt, sets.generated, *sets.listed.values()) if tokens}:
        per_layer: dict[Any, list[int]] = {}
        for i in indices:
            if resolved[i].get("value", "layer_output") == "layer_output":  # a patch elsewhere shares no entry
                layers = resolved[i]["layers"]
                for layer in [layers] if layers == EVERYWHERE else layers:
                    per_layer.setdefault(layer, []).append(i)
        for layer, acting in per_layer.items():
            capping = [i for i, slot in zip(acting, slotted([resolved[i] for i in acting])) if slot]
            if len(capping) > directions_per_block:
                where = "at every location (layers='all')" if layer == EVERYWHERE else f"at layer {layer}"
                added = [i for i in capping if resolved[i]["kind"] == "add"]
                adds = (
                    f" (additions {added} take a slot each: gated, or relative beside an absolute one or a patch)"
                    if added
                    else ""
                )
                raise ValueError(
                    f"{WHAT}: specs {capping} cap, ablate or clamp {len(capping)} directions on the same tokens "
                    f"{where}{adds}; the engine applies at most {directions_per_block} per token there (an engine "
                    "built with SteeredVLLM(..., steering_directions_per_block=N) applies N): ablate their span in "
                    "fewer directions, or spread them over blocks or positions"
                )


def _digest(entry: dict[str, Any]) -> str:
    """What a spec in engine form does, hashed: everything but its positions."""
    vectors = [value for key, value in sorted(entry.items()) if key in ("vector", "write")]
    what = [[key, value] for key, value in sorted(entry.items()) if key not in ("vector", "write", "positions")]
    packed = b"".join(struct.pack(f"<{len(vector)}f", *vector) for vector in vectors)
    return hashlib.sha256(json.dumps(what).encode() + packed).hexdigest()


@dataclass(frozen=True)
class TokenSets:
    """Which specs of a request act on which of its tokens: each a tuple of spec indices (empty: none)."""

    prompt_length: int
    #: On a prompt token no listed position names.
    prompt: tuple[int, ...]
    #: On a generated token.
    generated: tuple[int, ...]
    #: On a prompt position some spec lists, by position.
    listed: dict[int, tuple[int, ...]]


def token_sets(steering: dict[str, Any]) -> TokenSets:
    """The `TokenSets` of a request's steering in engine form."""
    phases = [spec["positions"] for spec in steering["specs"]]
    prompt = tuple(i for i, phase in enumerate(phases) if phase in ("all", "prompt"))
    generated = tuple(i for i, phase in enumerate(phases) if phase in ("all", "generated"))
    listed: dict[int, tuple[int, ...]] = {}
    for i, phase in enumerate(phases):
        if not isinstance(phase, str):
            for position in phase:
                listed[position] = listed.get(position, prompt) + (i,)
    return TokenSets(steering["prompt_tokens"], prompt, generated, listed)


__all__ = [
    "DIRECTIONS_PER_BLOCK",
    "EVERYWHERE",
    "EVERYWHERE_VALUES",
    "STEERING_VALUES",
    "EXTRA_ARGS_KEY",
    "Ablate",
    "Cap",
    "Clamp",
    "HEADROOM",
    "KINDS",
    "PATCHED_VALUES",
    "Patch",
    "SCALES",
    "Steering",
    "TokenSets",
    "decode_only",
    "feature_change",
    "gate_before",
    "is_relative",
    "kind_fields",
    "projection_change",
    "per_prompt",
    "relative_addition",
    "relative_direction",
    "request_steering",
    "slotted",
    "specs_of",
    "token_sets",
]
