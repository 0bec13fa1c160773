"""The root's edits of a value inside an nnsight trace: `steer`, `cap`, `ablate`, `clamp` and `patch`.

Each is what its spec (`nnterp_vllm.Steering`, `Cap`, `Ablate`, `Clamp`, `Patch`) does inside the steered engine,
done on the nnsight path: checked first, then applied to the values it names through their descriptors, on either
engine. `Standardized` serves them; they read its sizes (``num_layers``, ``hidden_size``), blocks and SAEs.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
from nnsight.intervention.interleaver import Mediator

from . import arguments
from .arguments import LayerSelection, Positions
from .components import Value
from .components.values import require_trace, writable_value
from .specs.saes import SAE

#: What ``when=`` takes: ``(Probe, op, threshold)`` or ``(sae, feature, op, threshold)`` (`specs.probes.gate`).
Gate = tuple[Any, ...]
#: Each invoke's block outputs before the steering edits at them, by the invoke's worker: block index -> (visit,
#: stream), the stream the first edit (or gate read) at the block's latest visit found (`_unsteered`).
_UNSTEERED: weakref.WeakKeyDictionary[Any, dict[int, tuple[int, torch.Tensor]]] = weakref.WeakKeyDictionary()


class TraceEdits:
    """`steer`, `cap`, `ablate`, `clamp` and `patch` inside a trace, for the standardized root that serves them."""

    def steer(
        self,
        layers: LayerSelection,
        vector: torch.Tensor | None = None,
        factor: float = 1.0,
        positions: Positions = None,
        token_positions: Positions = None,
        batch_index: int | Iterable[int] | None = None,
        *,
        steering_vector: torch.Tensor | None = None,
        when: Gate | None = None,
        scale: str = "absolute",
    ) -> None:
        """Add ``factor * vector`` to the residual stream leaving ``layers``, at ``positions`` (all by default).

        ``vector`` is ``[hidden_size]``, or ``[n, hidden_size]`` with one row per selected position.
        ``batch_index`` steers only those rows of the invoke's batch (all by default; on vLLM an invoke
        holds one prompt). nnterp's spellings name the same arguments: ``steering_vector=`` is ``vector``,
        ``token_positions=`` is ``positions``. ``when``: a gate, as `nnterp_vllm.Steering` takes it
        (``(Probe, op, threshold)`` or ``(sae, feature, op, threshold)``, read at a block at or before the first
        of ``layers``): only the tokens whose read passes are steered. Call inside a trace or generate, before the
        first steered layer (and the gate's block) runs. The arguments are checked before anything is read from
        the model; positions and batch rows against the invoke's prompt.

        ``scale``: ``"absolute"`` (default) adds ``factor * vector``; ``"relative"`` adds ``factor * |h| * vector /
        |vector|`` (each row of a ``[n, hidden_size]`` vector normalised on its own), ``h`` the stream leaving the
        block at that token before any edit there and ``|h|`` its L2 norm over the hidden dimension, in float32:
        the factor is a fraction of the stream's own size, comparable across blocks and models. What
        ``nnterp_vllm.Steering(..., scale="relative")`` does inside the steered engine.
        """
        from .specs.steering import check_scale, unit_direction
        from .specs.stream_changes import relative_addition, relative_direction

        require_trace("steer")
        vector = _one_spelling("steer", ("vector", vector), ("steering_vector", steering_vector), required=True)
        chosen = _one_spelling("steer", ("positions", positions), ("token_positions", token_positions))
        indices = arguments.layer_indices(layers, self.num_layers, "steer")
        vector = arguments.hidden_vector(vector, self.hidden_size, "steer")
        factor = arguments.finite_number(factor, "steer")
        check_scale(scale, "steer")
        relative = scale == "relative"
        if relative:
            for row in vector.reshape(-1, vector.shape[-1]):
                unit_direction(row, "steer (scale='relative')")
            unit = relative_direction(vector)

        def add(selected: torch.Tensor, unsteered: torch.Tensor) -> torch.Tensor:
            if vector.dim() == 2 and vector.shape[0] not in (1, selected.shape[1]):
                raise ValueError(
                    f"steer: a [n, hidden_size] vector needs one row per steered position; it has "
                    f"{vector.shape[0]} rows for {selected.shape[1]} positions"
                )
            if relative:
                return selected + relative_addition(unit, factor, unsteered, selected.dtype)
            return selected + factor * vector.to(device=selected.device, dtype=selected.dtype)

        self._edit_stream("steer", self._block_outputs(indices), chosen, batch_index, add, when)

    def cap(
        self,
        layers: LayerSelection,
        vector: torch.Tensor,
        min: float | None = None,
        max: float | None = None,
        positions: Positions = None,
        batch_index: int | Iterable[int] | None = None,
        *,
        when: Gate | None = None,
    ) -> None:
        """Clamp the residual stream's projection on the direction ``vector`` (``[hidden_size]``, normalised here)
        to ``[min, max]`` where it leaves ``layers``, at ``positions`` (all by default) and ``batch_index`` rows (as
        `steer` takes them), on the tokens whose gate ``when`` passes (all without one; as `steer` takes it): the
        stream ``h`` becomes ``h + (clamp(h . u, min, max) - h . u) * u``. Either bound may be left out, not both.
        What `nnterp_vllm.Cap` does inside the steered engine. Call inside a trace."""
        from .specs.steering import Cap

        require_trace("cap")
        self._apply_direction(Cap(vector, layers, min, max, when=when), positions, batch_index)

    def ablate(
        self,
        layers: LayerSelection | str,
        vector: torch.Tensor,
        positions: Positions = None,
        batch_index: int | Iterable[int] | None = None,
        *,
        when: Gate | None = None,
    ) -> None:
        """Remove the direction ``vector`` (``[hidden_size]``, normalised here) from the residual stream, at
        ``positions`` (all by default) and ``batch_index`` rows (as `steer` takes them): the stream ``h`` becomes
        ``h - (h . u) * u``. ``layers="all"``: at every residual-stream location (the stream entering the first
        block, what each block's attention and MLP add), so the stream never carries it (`nnterp_vllm.Ablate`
        says which locations and why); else the stream leaving those blocks. ``when``: a gate, as `steer` takes it
        (with block indices only): only the tokens whose read passes lose the direction. What `nnterp_vllm.Ablate`
        does inside the steered engine. Call inside a trace, before the first block it edits runs (with ``"all"``,
        after every other edit of the invoke: it edits every block)."""
        from .specs.steering import Ablate

        require_trace("ablate")
        self._apply_direction(Ablate(vector, layers, when=when), positions, batch_index)

    def clamp(
        self,
        sae: SAE | str | os.PathLike,
        feature: int,
        value: float | None = None,
        scale: float | None = None,
        positions: Positions = None,
        batch_index: int | Iterable[int] | None = None,
        *,
        when: Gate | None = None,
    ) -> None:
        """Set feature ``feature`` of the SAE ``sae`` to ``value`` (or multiply it by ``scale``; give exactly one)
        where the stream it reads leaves its block, at ``positions`` (all by default) and ``batch_index`` rows (as
        `steer` takes them): the stream ``h`` becomes ``h + (target - a) * d``, ``a`` the feature's activation by
        the SAE's own encoder (``sae.encode(h)[..., feature]``, as SAELens computes it), ``d`` its decoder row
        (``sae.decoder_rows()[feature]``) and ``target`` ``value`` or ``scale * a``. ``sae`` is the name of an SAE
        the model holds (``saes=[...]``), a loaded `SAE` or a SAELens SAE directory. ``when``: a gate, as `steer`
        takes it: only the tokens whose read passes are clamped. What `nnterp_vllm.Clamp` does inside the steered
        engine. Call inside a trace, before the SAE's block runs."""
        from .specs.steering import Clamp
        from .specs.stream_changes import feature_change

        require_trace("clamp")
        spec = Clamp(self._sae_named(sae), feature, value, scale, when=when)
        sae = spec.sae
        if sae.layer >= self.num_layers or sae.d_in != self.hidden_size:
            raise ValueError(
                f"clamp: {sae.path} reads block {sae.layer}'s output, {sae.d_in} wide; this model has "
                f"{self.num_layers} blocks, {self.hidden_size} wide"
            )
        low, high = spec.bounds if spec.value is not None else (-math.inf, math.inf)
        factor = 1.0 if spec.scale is None else spec.scale

        def clamped(selected: torch.Tensor, unsteered: torch.Tensor) -> torch.Tensor:
            on = sae.on(selected.device)
            row = on.decoder_rows()[spec.feature]
            active = on.encode(selected)[..., spec.feature]
            return selected + feature_change(selected, row, row, low, high, scale=factor, pre=active)

        self._edit_stream("clamp", self._block_outputs([sae.layer]), positions, batch_index, clamped, spec.when)

    def patch(
        self,
        layers: LayerSelection,
        vectors: torch.Tensor | Sequence[Any],
        positions: Sequence[int],
        value: str = "layer_output",
        batch_index: int | Iterable[int] | None = None,
    ) -> None:
        """Set ``value`` (``"layer_output"``, ``"attention_output"`` or ``"mlp_output"``) of the blocks ``layers`` to
        ``vectors`` at the prompt ``positions`` of the ``batch_index`` rows (all by default): ``h' = v`` there.
        ``vectors`` is one ``[hidden_size]`` vector for every position or ``[len(positions), hidden_size]``, a row per
        position in the order given (activation patching: rows a clean run saved). What `nnterp_vllm.Patch` does
        inside the steered engine. Call inside a trace, before the first patched block runs."""
        from .specs.patch import Patch

        require_trace("patch")
        spec = Patch(vectors, layers, positions, value)
        indices = arguments.layer_indices(spec.layers, self.num_layers, "patch")
        rows = arguments.hidden_vector(spec.rows(), self.hidden_size, "patch")
        stream = spec.value == "layer_output"
        targets = [
            (*writable_value(self, f"layers.{index}.{spec.value}", "patch"), index if stream else None)
            for index in indices
        ]

        def set_rows(selected: torch.Tensor, unsteered: torch.Tensor) -> torch.Tensor:
            return rows.to(device=selected.device, dtype=selected.dtype).expand_as(selected)

        self._edit_stream("patch", targets, spec.positions, batch_index, set_rows)

    def _sae_named(self, sae: Any) -> Any:
        """``sae`` as `clamp` takes it: the held SAE of that name, else as given (a loaded SAE or a directory)."""
        if not isinstance(sae, str):
            return sae
        if sae in self.saes:
            return self.saes[sae]
        if not os.path.isdir(sae):
            held = ", ".join(repr(name) for name in self.saes) or "none (build the model with saes=[...])"
            raise ValueError(f"clamp: {sae!r} is neither an SAE this model holds nor an SAE directory; it holds {held}")
        return sae

    def _apply_direction(self, spec: Any, positions: Positions, batch_index: Any) -> None:
        """A checked `Cap` (or `Ablate`) applied where it names, by `_edit_stream`."""
        from .specs.steering import EVERYWHERE, EVERYWHERE_VALUES
        from .specs.stream_changes import projection_change

        what = spec.what.lower()
        if spec.layers == EVERYWHERE:
            names = [name.replace("*", str(i)) for i in range(self.num_layers) for name in EVERYWHERE_VALUES]
            targets = [(*writable_value(self, name, f"{what}(layers='all')"), None) for name in dict.fromkeys(names)]
        else:
            targets = self._block_outputs(arguments.layer_indices(spec.layers, self.num_layers, what))
        direction = arguments.hidden_vector(spec.vector, self.hidden_size, what, rows=False)

        def clamp(selected: torch.Tensor, unsteered: torch.Tensor) -> torch.Tensor:
            unit = direction.to(device=selected.device)
            return selected + projection_change(selected, unit, spec.min, spec.max)

        self._edit_stream(what, targets, positions, batch_index, clamp, spec.when)

    def _block_outputs(self, indices: Iterable[int]) -> list[tuple[Any, Value, int]]:
        """The ``layer_output`` of the blocks ``indices`` as `_edit_stream` targets."""
        return [(self.layers[index], type(self.layers[index]).layer_output, index) for index in indices]

    def _edit_stream(
        self,
        what: str,
        targets: list[tuple[Any, Value, int | None]],
        positions: Positions,
        batch_index: Any,
        edit: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        when: Gate | None = None,
    ) -> None:
        """Replace each ``(host, value, block)`` of ``targets`` (in forward order; ``block`` the index of the block
        whose output the value is, else ``None``), at ``positions`` of the ``batch_index`` rows, by ``edit`` of it
        (``[rows, positions, hidden]`` in, the same out; its second argument the same positions of the value before
        any edit at that block, `_unsteered`, which a relative `steer` measures), only on the tokens whose gate
        ``when`` passes where one is given: read at its block's output before the steering there (`_unsteered`), as
        the steered engine reads it. Arguments checked first."""
        from .specs.probes import gate_passes
        from .specs.steering import gate_before

        where = arguments.positions(_listed(positions), what)
        batch = arguments.batch_rows(_listed(batch_index), what)
        blocks = [block for *_, block in targets]
        gate = None if when is None else gate_before(when, blocks, self.num_layers, self.hidden_size, what)
        passed: list[torch.Tensor] = []  # the gate's verdict per token, once read

        def replaced(stream: torch.Tensor, host: Any, value: Value, block: int | None) -> torch.Tensor:
            selected = arguments.positions_within(where, stream.shape[1], what)
            rows = arguments.batch_rows_within(batch, stream.shape[0], what)
            before = stream if block is None else _unsteered(host, value, block, stream)
            if gate is not None and block == gate["layer"]:
                passed.append(gate_passes(gate, before))
            stream = stream.clone()
            at = (torch.tensor(rows)[:, None], torch.tensor(selected))
            changed = edit(stream[at], before[at])
            if gate is not None:
                changed = torch.where(passed[-1].to(stream.device)[at][..., None], changed, stream[at])
            stream[at] = changed
            return stream

        if gate is not None and gate["layer"] not in blocks:
            host = self.layers[gate["layer"]]
            value = type(host).layer_output
            passed.append(gate_passes(gate, _unsteered(host, value, gate["layer"], value.peek(host))))
        for host, value, block in targets:
            value.update(host, partial(replaced, host=host, value=value, block=block))


def _unsteered(host: Any, value: Value, block: int, stream: torch.Tensor) -> torch.Tensor:
    """Block ``block``'s output before any steering edit at it, at this visit of the invoke's worker: the stream the
    first edit (or gate read) there found, recorded now if none did (``stream``: the output as the trace holds it
    now, ``value`` on ``host``)."""
    mediator = Mediator.current(f"{host.path}.{value.name}")
    visit = mediator.occurrence(value.locate(host)[0])
    held = _UNSTEERED.setdefault(mediator, {})
    if block not in held or held[block][0] != visit:
        held[block] = (visit, stream)
    return held[block][1]


def _one_spelling(what: str, ours: tuple[str, Any], nnterps: tuple[str, Any], required: bool = False) -> Any:
    """The argument given under our name or nnterp's (never both), e.g. ``vector`` / ``steering_vector``."""
    (name, value), (other, other_value) = ours, nnterps
    if value is not None and other_value is not None:
        raise ValueError(f"{what}: {name}= and {other}= are two spellings of one argument; give one, not both")
    if required and value is None and other_value is None:
        raise TypeError(f"{what}: missing the {name} argument (nnterp spells it {other}=)")
    return other_value if value is None else value


def _listed(chosen: Any) -> Any:
    """A tensor of indices (as nnterp code passes them) as an int or a list of ints; anything else as it is."""
    return chosen.tolist() if isinstance(chosen, torch.Tensor) else chosen
