"""The steering specs (`Steering`, `Cap`, `Ablate`, `Clamp`): declarative steering, checked on the client, carried
per request into the engine.

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
`Patch` (`specs.patch`) sets values instead of moving them; `specs.steering_requests` holds what a request carries
and its engine form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import arguments
from .stream_changes import relative_direction

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
#: What a `Steering`'s factor is measured against: ``"absolute"`` (the vector's own size) or ``"relative"`` (the
#: residual stream's norm at that block and token).
SCALES = ("absolute", "relative")


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
            threshold)`` (`specs.probes.gate`), read at a block at or before this spec's, per token; the spec acts
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


def check_scale(scale: Any, what: str) -> None:
    """Refuse a ``scale`` that is not one of `SCALES` (``ValueError`` naming what is allowed)."""
    if not isinstance(scale, str) or scale not in SCALES:
        raise ValueError(
            f"{what}: scale must be 'absolute' (factor x vector) or 'relative' (factor x the stream's norm x the "
            f"vector's direction), got {scale!r}"
        )


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


__all__ = [
    "EVERYWHERE",
    "EVERYWHERE_VALUES",
    "SCALES",
    "STEERING_VALUES",
    "Ablate",
    "Cap",
    "Clamp",
    "Steering",
    "gate_before",
]
