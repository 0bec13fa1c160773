"""The steering operation of the steered engine, on its worker: one static operation at every location it acts at.

At every standardized block's ``layer_output`` (located through the model's family in ``families/vllm/``, so exactly
where `Standardized.steer` adds), and at each location of what its attention and its MLP add and of the stream
entering the first block, a forward hook looks up each token's entry of the steering pool (`steering_pool`): ``entry
= rows[location, token_rows[token]]``, then keeps ``keep[entry]`` of the stream (1, or 0 where a `Patch` sets it)
and adds ``vectors[entry, 0]`` (times the stream's float32 norm where ``relative[entry]``: a relative `Steering`'s
``factor * unit``) and, for each of the entry's direction slots in turn (`DIRECTIONS_PER_BLOCK` unless
the engine is built with another number), moves the stream's activation along the slot's read direction to its
target along its write direction (`specs.stream_changes.feature_change`, with the slot's ``parameters``: bounds, offset,
threshold, scale, and for a TopK SAE's feature its index). Adding, ablating, capping and clamping an SAE feature are
the one operation: an entry that only adds holds zero directions, a cap reads and writes its unit direction with no
threshold, an ablation is a cap to ``[0, 0]``, a clamp reads the feature's encoder column (its offset and threshold
the bias and the activation's) and writes its decoder row; a patch keeps none of the stream and adds its vector.
Entry 0 keeps the stream and moves nothing (zero directions write nothing); row 0 names entry 0 at every location.
An `Ablate` at every residual-stream location (`specs.steering.EVERYWHERE_VALUES`) is its directions at each
attention's and MLP's output and at the stream entering the first block.

The buffers come from the memory model (`memory`), allocated once as the model loads (before vLLM profiles memory
and compiles the model), and are only ever written in place before each step (`steerer.Steerer.fill`): the content
of entries and rows the scheduler placed and the worker does not hold yet, and each scheduled token's row. The
compiled graph, and the CUDA graphs captured over these very buffers on GPUs, serve every step and any mix of
requests.

A TopK SAE's feature is active only among the ``k`` largest of all its features, which only its whole encoder
says: a step in which some token clamps one runs eagerly (the runner bypasses the compiled graph for it), and there
the operation encodes just those tokens, once, at the SAE's block (keeping their pre-activations current through
each slot's change, which moves them linearly); the compiled graph holds no encoder at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...components.values import Located
from ...specs.steering import EVERYWHERE
from ...specs.steering_requests import is_relative, slotted
from ...specs.stream_changes import feature_change
from .memory import STEERING_PARAMS, Ledger
from .placement import graph_op, runs
from .sae_encoding import DeviceSAE
from .steering_pool import LOCATED_VALUES

#: A direction slot's parameters, in ``params``' last axis.
(
    LOW,
    HIGH,
    OFFSET,
    THRESHOLD,
    SCALE,
    TOPK_FEATURE,
    GATE_COLUMN,
    GATE_OP,
    GATE_THRESHOLD,
    GATE_FLOOR,
    GATE_SIGMOID,
    RELATIVE,
) = range(STEERING_PARAMS)
#: The probe buffers: the table's attribute -> the memory model's buffer.
PROBE_BUFFERS = {
    "probe_weights": "probe weights",
    "probe_bias": "probe bias",
    "probe_blocks": "probe blocks",
    "probe_scores": "probe scores",
}


@graph_op(mutates="scores")
def keep_scores(scores: torch.Tensor, read: torch.Tensor, here: torch.Tensor) -> None:
    """Write a block's probe reads (``read``, ``[tokens, columns]``) into the step's ``scores`` for the columns read
    at this block (``here``): the one write probes add to the compiled graph (`placement.graph_op`)."""
    held = scores[: read.shape[0]]
    torch.where(here, read, held, out=held)


#: The table's buffers: its attribute -> the memory model's buffer.
TABLE_BUFFERS = {
    "vectors": "steering vectors",
    "params": "steering parameters",
    "keep": "steering keep",
    "relative": "steering relative",
    "rows": "steering rows",
    "token_rows": "steering token rows",
}


class SteeringTable(torch.nn.Module):
    """The steering buffers (the memory model's ``steering ...``, `TABLE_BUFFERS`): ``vectors [entries, 1 + 2 *
    directions, hidden]`` (each entry's added vector, then its directions' read and write vectors), ``params
    [entries, directions, PARAMS]``, ``keep [entries]`` (how much of the stream each entry keeps), ``relative
    [entries]`` (1 where the entry's added vector is a fraction of the stream's norm, `RELATIVE`), ``rows
    [locations, rows]`` (each row's entry at each location) and ``token_rows`` (each scheduled token's row); and the
    TopK SAEs the engine holds, by block.

    Registered on every steered block (non-persistent buffers: no weight file names them), so the compiled graph
    reads them as inputs at stable module paths; they are only ever written in place.
    """

    def __init__(self, ledger: Ledger, topk: dict[int, DeviceSAE], encoding: torch.Tensor | None) -> None:
        super().__init__()
        for name, buffer in TABLE_BUFFERS.items():
            self.register_buffer(name, ledger.allocate(buffer, fill=1.0 if name == "keep" else 0.0), False)
        neutral_parameters(self.params)
        #: The locations that are a block's output (the first ones, `steering_pool.location`): relative additions act
        #: there only.
        self.blocks = (self.rows.shape[0] - 1) // len(LOCATED_VALUES)
        for name, buffer in PROBE_BUFFERS.items():
            held = ledger.allocate(buffer, fill=-1 if name == "probe_blocks" else 0.0) if buffer in ledger else None
            self.register_buffer(name, held, False)
        self.topk = topk
        self.encoding = encoding
        #: How many times the steering operation ran as Python rather than inside a compiled graph.
        self.eager_calls = 0
        #: Whether no token of the step being run is steered (`Steerer.fill`): an eager step then skips the operation
        #: (`placement.runs`).
        self.idle = True

    @property
    def directions(self) -> int:
        """Direction slots per entry."""
        return self.params.shape[1]

    def read_probes(self, layer: int, stream: torch.Tensor) -> None:
        """Read every probe column at block ``layer``'s output (``stream``, before its steering) into the step's
        scores, for the columns whose block it is; pure tensor code (nothing where the engine reads no probes)."""
        if self.probe_weights is None:
            return
        flat = stream.reshape(-1, stream.shape[-1])
        read = (flat @ self.probe_weights.T).float() + self.probe_bias
        torch.ops.nnterp_vllm.keep_scores(self.probe_scores, read, self.probe_blocks == layer)

    def steered(self, location: int, stream: torch.Tensor) -> torch.Tensor:
        """What to add to ``stream`` (``[tokens, hidden]``, or ``[1, tokens, hidden]``) at ``location`` (for each
        token, what its entry does not keep of the stream taken off, its vector added (times the stream's norm where
        the entry is relative), then each of its directions in turn); pure tensor code.

        At a block's output (the locations before `blocks`, where a relative `Steering` acts) the stream's norm
        (float32, over the hidden dimension, of ``stream``: the value before any edit here) is computed for every
        token in every step, one reduction as wide as a direction's read; a token whose entry and slots are absolute
        takes a coefficient of exactly 1 (`torch.where`, never ``1 + 0 * norm``), so its result is bit for bit what
        it was without relative scales. Elsewhere (what attention and MLPs add, the first block's input) nothing of
        it is computed."""
        entry = self.rows[location].index_select(0, self.token_rows[: stream.shape[-2]])
        slots = self.vectors.index_select(0, entry)
        held = self.params.index_select(0, entry)
        dropped = (self.keep.index_select(0, entry) - 1.0)[:, None].to(stream.dtype)
        norm = None
        added = slots[:, 0]
        if location < self.blocks:  # a block's output, where relative additions act (a Python int: no graph branch)
            norm = torch.linalg.vector_norm(stream, dim=-1, dtype=torch.float32).reshape(-1)
            added = (added.float() * _times_norm(self.relative.index_select(0, entry), norm)[:, None]).to(stream.dtype)
        base = added + dropped * stream
        delta = base
        passes = self._passes(held, slice(0, stream.shape[-2]))
        for slot in range(self.directions):
            delta = delta + self._gated(self._change(stream + delta, slots, held, slot, norm), passes, slot)
        sae = self.topk.get(location)
        if sae is not None and not torch.compiler.is_compiling():  # a TopK step runs eagerly (`Steerer.eager`)
            delta = self._with_topk(sae, stream, slots, held, base, delta, norm)
        return delta

    def _passes(self, held: torch.Tensor, tokens: slice | torch.Tensor) -> torch.Tensor | None:
        """Whether each token's slots' gates pass (``held``: the slots' parameters, ``[tokens, directions, PARAMS]``;
        ``tokens``: where those tokens' probe scores sit this step), ``[tokens, directions]``; a slot with no gate
        always passes (``None``: the engine reads no probes, so nothing is gated). A gate reads its column of the
        scores, through a sigmoid where asked and zero up to its floor, and compares it with its threshold. Computed
        for all slots at once, so the compiled graph evaluates it once per token rather than in each slot's loop over
        the hidden dimension."""
        if self.probe_scores is None:
            return None
        column = held[..., GATE_COLUMN]
        read = self.probe_scores[tokens].gather(1, column.clamp(min=0).long())
        read = torch.where(held[..., GATE_SIGMOID] > 0, read.sigmoid(), read)
        value = torch.where(read > held[..., GATE_FLOOR], read, torch.zeros_like(read))
        op, threshold = held[..., GATE_OP], held[..., GATE_THRESHOLD]
        passed = torch.where(
            op == 0,
            value > threshold,
            torch.where(op == 1, value >= threshold, torch.where(op == 2, value < threshold, value <= threshold)),
        )
        return (column < 0) | passed

    @staticmethod
    def _gated(change: torch.Tensor, passes: torch.Tensor | None, slot: int) -> torch.Tensor:
        """``change`` (``[tokens, hidden]``, direction ``slot``'s) where its gate passes (`_passes`)."""
        return change if passes is None else change * passes[:, slot, None].to(change.dtype)

    @staticmethod
    def _change(
        current: torch.Tensor,
        slots: torch.Tensor,
        held: torch.Tensor,
        slot: int,
        norm: torch.Tensor | None,
        **topk: Any,
    ) -> torch.Tensor:
        """What direction ``slot`` adds to ``current`` (`feature_change` with the slot's vectors and parameters; a
        relative slot's bounds, a relative addition's factor, times each token's ``norm`` where one is given)."""
        at = held[:, slot]
        low, high = at[:, LOW], at[:, HIGH]
        if norm is not None:
            times = _times_norm(at[:, RELATIVE], norm)
            low, high = low * times, high * times
        return feature_change(
            current,
            slots[:, 1 + 2 * slot],
            slots[:, 2 + 2 * slot],
            low,
            high,
            offset=at[:, OFFSET],
            threshold=at[:, THRESHOLD],
            scale=at[:, SCALE],
            **topk,
        )

    def _with_topk(
        self,
        sae: DeviceSAE,
        stream: torch.Tensor,
        slots: torch.Tensor,
        held: torch.Tensor,
        base: torch.Tensor,
        delta: torch.Tensor,
        norm: torch.Tensor | None,
    ) -> torch.Tensor:
        """``delta`` (``base``: what it was before the directions; ``norm``: each token's stream norm) with the
        tokens whose entry clamps a feature of
        ``sae`` done again, exactly: their features
        encoded once (in parts, into the engine's encoding buffer), kept current through each slot's change (a
        change along ``w`` moves the pre-activations by ``(w @ W_enc) * norms``), each TopK slot's activation its
        feature's pre-activation where that is among the ``k`` largest."""
        named = held[:, :, TOPK_FEATURE] >= 0
        tokens = named.any(-1).nonzero().flatten()
        if not len(tokens):
            return delta
        width = stream.shape[-1]
        flat, base = stream.reshape(-1, width), base.reshape(-1, width)
        exact_delta = delta.reshape(-1, width).clone()
        part = max(1, self.encoding.numel() // sae.d_sae)
        for start in range(0, len(tokens), part):
            chosen = tokens[start : start + part]
            slots_of, held_of, norm_of = slots[chosen], held[chosen], None if norm is None else norm[chosen]
            added = base[chosen]  # what the entry keeps and adds, before its directions
            out = self.encoding.view(-1)[: len(chosen) * sae.d_sae].view(len(chosen), sae.d_sae)
            pre = sae.pre_activation(flat[chosen] + added, out)
            passes = self._passes(held_of, chosen)
            change = added
            for slot in range(self.directions):
                feature = held_of[:, slot, TOPK_FEATURE]
                kth = pre.topk(sae.k, dim=-1).values[:, -1]
                own = self._change(flat[chosen] + change, slots_of, held_of, slot, norm_of)
                exact = self._change(
                    flat[chosen] + change,
                    slots_of,
                    held_of,
                    slot,
                    norm_of,
                    pre=pre.gather(-1, feature.clamp(min=0).long()[:, None])[:, 0],
                    floor=kth,
                )
                step = self._gated(torch.where((feature >= 0)[:, None], exact, own), passes, slot)
                change = change + step
                pre += (step.float() @ sae.W_enc) * sae.decoder_norms
            exact_delta[chosen] = change.to(delta.dtype)
        return exact_delta.reshape(delta.shape)


def _times_norm(relative: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """Per token: its stream's ``norm`` where ``relative`` (an entry's or a slot's flag) is set, else exactly 1."""
    return torch.where(relative > 0, norm, torch.ones_like(norm))


def neutral_parameters(parameters: torch.Tensor) -> torch.Tensor:
    """Fill ``parameters`` (``[..., PARAMS]``) with parameters that move nothing; returns it."""
    parameters.zero_()
    parameters[..., LOW], parameters[..., HIGH], parameters[..., THRESHOLD] = -torch.inf, torch.inf, -torch.inf
    parameters[..., SCALE], parameters[..., TOPK_FEATURE], parameters[..., GATE_COLUMN] = 1.0, -1.0, -1.0
    parameters[..., GATE_FLOOR] = -torch.inf
    return parameters


def entry_content(
    specs: Sequence[dict[str, Any]], hidden: int, directions: int, gates: Sequence[int | None] = ()
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """One entry's content from the specs (engine form) it applies, in order: ``[1 + 2 * directions, hidden]`` (a
    patch's vector and the ungated added vectors, summed, then each cap's, clamp's or gated addition's read and
    write vectors in the next slot), ``[directions, PARAMS]`` parameters (``-inf`` / ``inf`` where a bound is left
    out; a gated spec's gate, reading the probe column ``gates[i]`` names for spec ``i``), how much of the
    stream it keeps (0 where a patch sets it, else 1), and whether its added vector is relative (1: the relative
    additions' ``factor * unit`` summed, times the stream's norm in the engine; else 0). A gated addition moves the
    stream by its vector times its factor (a slot reading nothing, its target that factor, times the stream's norm
    where it is relative: `RELATIVE`) where its gate passes; so does an ungated relative addition beside an absolute
    one or a patch (`specs.steering_requests.slotted`)."""
    content = torch.zeros(1 + 2 * directions, hidden, dtype=torch.float32)
    parameters = neutral_parameters(torch.empty(directions, STEERING_PARAMS))
    keep = 1.0
    relative = 0.0
    slot = 0
    for spec, column, in_slot in zip(specs, list(gates) + [None] * (len(specs) - len(gates)), slotted(specs)):
        vector = torch.tensor(spec["vector"], dtype=torch.float32)
        if not in_slot:
            content[0] += spec.get("factor", 1.0) * vector
            keep = 0.0 if spec["kind"] == "patch" else keep
            relative = 1.0 if is_relative(spec) else relative
            continue
        held = parameters[slot]
        if spec["kind"] == "add":  # gated (or relative beside an absolute addition): reads nothing, moves by factor
            content[2 + 2 * slot] = vector
            low = high = spec["factor"]
            held[RELATIVE] = float(is_relative(spec))
        else:
            content[1 + 2 * slot] = vector
            content[2 + 2 * slot] = torch.tensor(spec["write"]) if "write" in spec else vector
            low, high = spec["min"], spec["max"]
        held[LOW], held[HIGH] = -torch.inf if low is None else low, torch.inf if high is None else high
        if column is not None:
            when = spec["when"]
            held[GATE_COLUMN], held[GATE_OP], held[GATE_THRESHOLD] = column, when["op"], when["threshold"]
            held[GATE_FLOOR] = -torch.inf if when["floor"] is None else when["floor"]
            held[GATE_SIGMOID] = float(when["sigmoid"])
        if spec["kind"] == "clamp":
            held[OFFSET], held[THRESHOLD], held[SCALE] = spec["offset"], spec["threshold"], spec["scale"]
            held[TOPK_FEATURE] = spec["topk"]["feature"] if spec["topk"] else -1
        slot += 1
    return content, parameters, keep, relative


def steer_at_output(module: torch.nn.Module, args: Any, output: Any) -> Any:
    """Forward hook where a location of the pool (what a block's attention or MLP adds) is a module's output: the
    tokens' entries applied there."""
    return _steered_at(module, module.nnterp_steered_outputs, output)


def steer_at_input(module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
    """Forward pre-hook (with kwargs) where such a location (the stream entering the first block) is a module's
    input."""
    return _steered_at(module, module.nnterp_steered_inputs, (args, kwargs))


def _steered_at(module: torch.nn.Module, places: Sequence[tuple[int, Located]], raw: Any) -> Any:
    steering = module.nnterp_steering
    if not runs(steering):
        return raw
    for at, place in places:
        part = place.part(raw)
        raw = place.replaced(raw, part + steering.steered(at, part))
    return raw


def steer_block(block: torch.nn.Module, args: Any, output: Any) -> Any:
    """Forward hook of a steered block: its output with each token's steering added to the stream."""
    if not runs(block.nnterp_steering):
        return output
    value = block.nnterp_layer_output
    stream = value.pick("output", output, value.select)
    block.nnterp_steering.read_probes(block.nnterp_layer, stream)
    return value.with_added(output, block.nnterp_steering.steered(block.nnterp_layer, stream))


__all__ = ["EVERYWHERE", "SteeringTable", "entry_content", "neutral_parameters"]
