"""The steering table of the steered engine, on its worker: one static operation at every standardized block.

At every standardized block's ``layer_output`` (located through the model's family in ``families/vllm/``, so
exactly where `Standardized.steer` adds) a forward hook adds ``table[layer, row_of_token, 0]`` and then, for each
of the row's direction slots in turn (`DIRECTIONS_PER_BLOCK` unless the engine is built with another number),
moves the stream's activation along the slot's read direction to its target along its write direction
(`steering.specs.feature_change`, with the slot's ``params``: bounds, offset, threshold, scale, and for a TopK
SAE's feature its index). ``table`` is a ``[layers + 1, rows, 1 +
2 * directions, hidden]`` buffer (the added vector, then each slot's read and write directions), ``params``
``[layers + 1, rows, directions, PARAMS]`` (row 0 adds nothing and moves nothing: a zero direction writes
nothing), ``row_of_token`` a ``[max_num_batched_tokens]`` index. Adding, ablating, capping and clamping an SAE
feature are the one operation: a row that only adds holds zero directions, a cap reads and writes its unit
direction with no threshold, an ablation is a cap to ``[0, 0]``, a clamp reads the feature's encoder column
(its offset and threshold the bias and the activation's) and writes its decoder row. At a block where the engine
holds a TopK SAE (``saes=[...]``) the operation also computes that SAE's pre-activations, so a TopK feature's
activation is what SAELens's encoder gives it (zero outside the ``k`` largest).
The last entry (``layers``) holds the directions ablated at every residual-stream location
(`steering.specs.EVERYWHERE_VALUES`: the stream entering the first block, each attention's and MLP's output), where the
same operation runs from hooks of their own. The buffers are allocated once, as the model loads (before vLLM
profiles memory and compiles the model), and only ever written in place before each step, from the scheduled
requests (their specs ride ``SamplingParams.extra_args``) and each token's position: the compiled graph, and the
CUDA graphs captured over these very buffers on GPUs, serve every step and any mix of requests.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .. import families
from ..components import vllm as on_vllm
from ..components.values import Located
from ..errors import UnsupportedFamily
from ..standardized import Standardized
from ..steering.saes import SAE
from ..steering.specs import (
    DIRECTIONS_PER_BLOCK,
    EVERYWHERE,
    EVERYWHERE_VALUES,
    EXTRA_ARGS_KEY,
    TokenSets,
    feature_change,
    token_sets,
)
from .capture import count_eager_run, locate
from .steered_settings import CONFIG_KEY

# -- worker side --------------------------------------------------------------------------------------


#: A direction slot's parameters, in ``params``' last axis.
LOW, HIGH, OFFSET, THRESHOLD, SCALE, TOPK_FEATURE = range(6)
PARAMS = 6


def table_slots(directions: int) -> int:
    """Vectors per table row with ``directions`` direction slots: the added vector, then each direction's read and
    write directions."""
    return 1 + 2 * directions


class TopKEncoder(torch.nn.Module):
    """A TopK SAE's encoder at its block, as buffers: every feature's pre-activation and each token's ``k``-th
    largest of them (float32)."""

    def __init__(self, sae: SAE, device: Any) -> None:
        super().__init__()
        self.k = sae.k
        with torch.inference_mode(False):
            self.register_buffer("W_enc", sae.W_enc.to(device), False)
            self.register_buffer("b_enc", sae.b_enc.to(device), False)
            self.register_buffer("b_dec", (sae.b_dec * sae.apply_b_dec_to_input).to(device), False)
            norms = sae.decoder_norms() if sae.rescale_acts_by_decoder_norm else torch.ones(sae.d_sae)
            self.register_buffer("norms", norms.to(device), False)

    def pre_activation(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``stream`` ``[tokens, hidden]``'s pre-activations ``[tokens, d_sae]`` and each token's ``k``-th largest
        (``[tokens]``); pure tensor code."""
        pre = ((stream.float() - self.b_dec) @ self.W_enc + self.b_enc) * self.norms
        return pre, pre.topk(self.k, dim=-1).values.amin(-1)


class SteeringTable(torch.nn.Module):
    """The per-step steering buffers: ``table [layers, rows, table_slots(directions), hidden]`` (each row's added
    vector, then its directions' read and write directions), ``params [layers, rows, directions, PARAMS]`` (row 0
    adds and moves nothing), ``row_of_token``, and the encoders of the TopK SAEs the engine holds, by block.

    Registered on every steered block (non-persistent buffers: no weight file names them), so the
    compiled graph reads them as inputs at stable module paths; they are only ever written in place.
    """

    def __init__(
        self,
        layers: int,
        rows: int,
        tokens: int,
        hidden: int,
        dtype: torch.dtype,
        device: Any,
        topk_saes: Sequence[SAE] = (),
        directions: int = DIRECTIONS_PER_BLOCK,
    ) -> None:
        super().__init__()
        slots = table_slots(directions)
        with torch.inference_mode(False):
            self.register_buffer("table", torch.zeros(layers, rows, slots, hidden, dtype=dtype, device=device), False)
            self.register_buffer("params", neutral_params(layers, rows, directions, device), False)
            self.register_buffer("row_of_token", torch.zeros(tokens, dtype=torch.long, device=device), False)
        self.encoders = torch.nn.ModuleDict({str(sae.layer): TopKEncoder(sae, device) for sae in topk_saes})
        #: How many times the steering operation ran as Python rather than inside a compiled graph.
        self.eager_calls = 0

    @property
    def everywhere(self) -> int:
        """The table's entry of the directions ablated at every residual-stream location."""
        return self.table.shape[0] - 1

    def steered(self, layer: int, stream: torch.Tensor) -> torch.Tensor:
        """What to add to ``stream`` (``[tokens, hidden]``, or ``[1, tokens, hidden]``) at table entry ``layer``
        (each token's vector, then each of its directions in turn); pure tensor code."""
        rows = self.row_of_token[: stream.shape[-2]]
        slots = self.table[layer].index_select(0, rows)
        params = self.params[layer].index_select(0, rows)
        encoder = self.encoders[str(layer)] if str(layer) in self.encoders else None
        delta = slots[:, 0]
        for slot in range(self.params.shape[2]):
            current = stream + delta
            read, write, held = slots[:, 1 + 2 * slot], slots[:, 2 + 2 * slot], params[:, slot]
            pre = floor = None
            if encoder is not None:
                pre, floor = topk_activation(encoder, current, read, held)
            delta = delta + feature_change(
                current,
                read,
                write,
                held[:, LOW],
                held[:, HIGH],
                offset=held[:, OFFSET],
                threshold=held[:, THRESHOLD],
                scale=held[:, SCALE],
                pre=pre,
                floor=floor,
            )
        return delta


def topk_activation(
    encoder: TopKEncoder, stream: torch.Tensor, read: torch.Tensor, held: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's pre-activation at its slot and the floor it must reach to be active: for a slot naming a TopK
    feature, that feature's pre-activation and the token's ``k``-th largest; for any other, the slot's read
    direction's and no floor."""
    flat = stream.reshape(-1, stream.shape[-1])
    every, kth = encoder.pre_activation(flat)
    feature = held[:, TOPK_FEATURE]
    named = feature >= 0
    chosen = every.gather(-1, feature.clamp(min=0).long()[:, None])[:, 0]
    own = (flat.float() * read.float()).sum(-1) + held[:, OFFSET]
    floor = torch.where(named, kth, torch.full_like(kth, -torch.inf))
    return torch.where(named, chosen, own).reshape(stream.shape[:-1]), floor.reshape(stream.shape[:-1])


def neutral_params(layers: int, rows: int, directions: int, device: Any = "cpu") -> torch.Tensor:
    """``[layers, rows, directions, PARAMS]`` parameters that move nothing: no bounds, no offset, no threshold,
    scale 1, no TopK feature."""
    params = torch.zeros(layers, rows, directions, PARAMS, dtype=torch.float32, device=device)
    params[..., LOW], params[..., HIGH], params[..., THRESHOLD] = -torch.inf, torch.inf, -torch.inf
    params[..., SCALE], params[..., TOPK_FEATURE] = 1.0, -1.0
    return params


def row_content(
    specs: Sequence[dict[str, Any]], entries: int, hidden: int, directions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One table row's content from the specs (engine form) it applies, in order: ``[entries,
    table_slots(directions), hidden]`` (the summed added vectors, then each cap's or clamp's read and write
    directions in the next free slot of its layers; the last entry for the directions ablated everywhere) and
    ``[entries, directions, PARAMS]`` parameters (``-inf`` / ``inf`` where a bound is left out)."""
    content = torch.zeros(entries, table_slots(directions), hidden, dtype=torch.float32)
    params = neutral_params(entries, 1, directions)[:, 0]
    used = [0] * entries
    for spec in specs:
        vector = torch.tensor(spec["vector"], dtype=torch.float32)
        for layer in [entries - 1] if spec["layers"] == EVERYWHERE else spec["layers"]:
            if spec["kind"] == "add":
                content[layer, 0] += spec["factor"] * vector
                continue
            slot = used[layer]
            used[layer] += 1
            content[layer, 1 + 2 * slot] = vector
            content[layer, 2 + 2 * slot] = torch.tensor(spec["write"]) if "write" in spec else vector
            held = params[layer, slot]
            low, high = spec["min"], spec["max"]
            held[LOW], held[HIGH] = -torch.inf if low is None else low, torch.inf if high is None else high
            if spec["kind"] == "clamp":
                held[OFFSET], held[THRESHOLD], held[SCALE] = spec["offset"], spec["threshold"], spec["scale"]
                held[TOPK_FEATURE] = spec["topk"]["feature"] if spec["topk"] else -1
    return content, params


def table_rows(vllm_config: Any) -> int:
    """Rows of an engine's steering table: row 0 (zeros) and room for every scheduled request's distinct rows."""
    scheduler = vllm_config.scheduler_config
    per_request = vllm_config.additional_config[CONFIG_KEY]["rows_per_request"]
    return 1 + min(scheduler.max_num_batched_tokens, per_request * scheduler.max_num_seqs)


def table_directions(vllm_config: Any) -> int:
    """Direction slots per row of an engine's steering table: caps, ablations and clamps one token may have at one
    block."""
    return vllm_config.additional_config[CONFIG_KEY]["directions_per_block"]


def ablate_at_output(module: torch.nn.Module, args: Any, output: Any) -> Any:
    """Forward hook where a value `steering.specs.EVERYWHERE_VALUES` names is a module's output: its directions
    ablated everywhere taken out."""
    return _ablated_everywhere(module, module.nnterp_everywhere_outputs, output)


def ablate_at_input(module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
    """Forward pre-hook (with kwargs) where such a value is a module's input."""
    return _ablated_everywhere(module, module.nnterp_everywhere_inputs, (args, kwargs))


def _ablated_everywhere(module: torch.nn.Module, places: Sequence[Located], raw: Any) -> Any:
    steering = module.nnterp_steering
    count_eager_run(steering)
    for place in places:
        part = place.part(raw)
        raw = place.replaced(raw, part + steering.steered(steering.everywhere, part))
    return raw


def steer_block(block: torch.nn.Module, args: Any, output: Any) -> Any:
    """Forward hook of a steered block: its output with each token's steering vector added to the stream."""
    count_eager_run(block.nnterp_steering)
    value = block.nnterp_layer_output
    stream = value.pick("output", output, value.select)
    return value.with_added(output, block.nnterp_steering.steered(block.nnterp_layer, stream))


def steered_blocks(model: torch.nn.Module, model_type: str) -> list[tuple[torch.nn.Module, Any]]:
    """The standardized blocks of a vLLM model in order, each with its family's ``layer_output`` value."""
    family = families.lookup(model_type, engine=families.VLLM)
    container = next((path for path, name in family.RENAME.items() if "layers" in _names(name)), None)
    try:
        blocks = model.get_submodule(container) if container else None
    except AttributeError:
        blocks = None
    if blocks is None:
        raise UnsupportedFamily(f"{family.__name__}: no module {container!r} holds the blocks of {type(model)}")
    found = []
    for block in blocks:
        envoy = next((family.ENVOYS[cls] for cls in type(block).__mro__ if cls in family.ENVOYS), None)
        value = getattr(envoy, "layer_output", None)
        if not isinstance(value, on_vllm.Flat) or value.key != "output":
            raise UnsupportedFamily(
                f"{family.__name__} serves layer_output of {type(block).__name__} elsewhere than its output; "
                "the steered engine adds at a block's output"
            )
        found.append((block, value))
    return found


def _names(name: Any) -> list[str]:
    return name if isinstance(name, list) else [name]


@dataclasses.dataclass
class RequestRows:
    """A steered request, as the runner keeps it: its token sets, each named by the key of its row content."""

    tokens: TokenSets
    prompt: tuple | None
    generated: tuple | None
    listed: dict[int, tuple | None]


class Steerer:
    """Installs the steering operation on a loaded model and fills its buffers before each step."""

    def __init__(
        self, model: torch.nn.Module, vllm_config: Any, device: torch.device, saes: Sequence[SAE] = ()
    ) -> None:
        model_config, scheduler = vllm_config.model_config, vllm_config.scheduler_config
        blocks = steered_blocks(model, Standardized._model_type(model_config.hf_config))
        if len(blocks) != model_config.hf_text_config.num_hidden_layers:
            raise UnsupportedFamily(
                f"found {len(blocks)} blocks in {type(model).__name__}, but its config has "
                f"num_hidden_layers={model_config.hf_text_config.num_hidden_layers}"
            )
        hidden = model_config.get_hidden_size()
        tokens = scheduler.max_num_batched_tokens
        rows, directions = table_rows(vllm_config), table_directions(vllm_config)
        topk = [sae for sae in saes if sae.architecture == "topk"]
        self.buffers = SteeringTable(
            len(blocks) + 1, rows, tokens, hidden, model_config.dtype, device, topk, directions
        )
        for index, (block, value) in enumerate(blocks):
            block.nnterp_steering = self.buffers
            block.nnterp_layer = index
            block.nnterp_layer_output = value
            block.register_forward_hook(steer_block)
        self.num_layers, self.hidden, self.directions = len(blocks), hidden, directions
        #: Why an `Ablate` at every residual-stream location cannot be served on this model, or ``None``.
        self.everywhere_reason = self._hook_everywhere(model, Standardized._model_type(model_config.hf_config))
        # On an accelerator the token rows and each new row's content are written into pinned host memory and
        # copied over without blocking, on the compute stream, before the step's forward. `fill` runs inside vLLM's
        # input preparation, which (under async scheduling) waits for the previous step's copies to have left
        # those host buffers before it starts (``synchronize_input_prep``), and otherwise follows the previous
        # step's synchronized output: no host buffer is written while a copy from it is pending.
        on_host = device.type == "cpu"
        self.host_rows = (
            self.buffers.row_of_token if on_host else torch.zeros(tokens, dtype=torch.long, pin_memory=True)
        )
        entries = len(blocks) + 1
        self.host_contents = (
            None
            if on_host
            else torch.zeros(rows, entries, table_slots(directions), hidden, dtype=model_config.dtype, pin_memory=True)
        )
        self.host_params = None if on_host else neutral_params(rows, entries, directions).pin_memory()
        self.host_rows_np = self.host_rows.numpy()
        self.written = 0
        self.requests: dict[str, RequestRows | None] = {}
        #: Row content by key (the digests of its specs, in the order they apply), for the keys of live requests.
        self.contents: dict[tuple, list[dict[str, Any]]] = {}
        self.users: collections.Counter = collections.Counter()
        #: Resident rows by content key, least recently used first; free rows.
        self.row_of_key: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        self.free_rows = list(range(rows - 1, 0, -1))
        self.row_writes = 0

    def _hook_everywhere(self, model: torch.nn.Module, model_type: str) -> str | None:
        """Hook every location of `steering.specs.EVERYWHERE_VALUES` (located through the family, as capture locates
        values); where one cannot be written, hook none and say why."""
        names = [name.replace("*", str(i)) for name in EVERYWHERE_VALUES for i in range(self.num_layers)]
        found = locate(model, model_type, list(dict.fromkeys(names)))
        for name, place in found.items():
            if isinstance(place, str) or place.replaced is None:
                why = place if isinstance(place, str) else "it is read-only there"
                return f"this family cannot write {name}: {why}"
        for place in found.values():
            module = model.get_submodule(place.module)
            module.nnterp_steering = self.buffers
            kind = "outputs" if place.attribute == "output" else "inputs"
            if not hasattr(module, f"nnterp_everywhere_{kind}"):
                setattr(module, f"nnterp_everywhere_{kind}", [])
                if kind == "outputs":
                    module.register_forward_hook(ablate_at_output)
                else:
                    module.register_forward_pre_hook(ablate_at_input, with_kwargs=True)
            getattr(module, f"nnterp_everywhere_{kind}").append(place)
        return None

    # -- requests -------------------------------------------------------------------------------------

    def request(self, request_id: str, state: Any) -> RequestRows | None:
        """The steering of a scheduled request (parsed once from its sampling params)."""
        if request_id in self.requests:
            return self.requests[request_id]
        extra = getattr(state.sampling_params, "extra_args", None) or {}
        wire = extra.get(EXTRA_ARGS_KEY)
        rows = None
        if wire is not None:
            tokens = token_sets(wire)
            specs, digests = wire["specs"], wire["digests"]

            def key(indices: tuple[int, ...]) -> tuple | None:
                # Additions commute (named in digest order, so any order shares a row); caps apply in request order.
                if not indices:
                    return None
                adding = sorted((i for i in indices if specs[i]["kind"] == "add"), key=lambda i: digests[i])
                order = adding + sorted(i for i in indices if specs[i]["kind"] != "add")
                named = tuple(digests[i] for i in order)
                if named not in self.contents:
                    self.contents[named] = [specs[i] for i in order]
                self.users[named] += 1
                return named

            listed = {position: key(indices) for position, indices in tokens.listed.items()}
            rows = RequestRows(tokens, key(tokens.prompt), key(tokens.generated), listed)
        self.requests[request_id] = rows
        return rows

    def forget(self, request_id: str) -> None:
        """Drop a finished request; its rows stay resident until another key needs the room."""
        rows = self.requests.pop(request_id, None)
        if rows is None:
            return
        for named in self._keys(rows):
            self.users[named] -= 1
            if self.users[named] <= 0:
                del self.users[named], self.contents[named]

    # -- per step -------------------------------------------------------------------------------------

    def fill(self, request_ids: Sequence[str], scheduled: np.ndarray, computed: np.ndarray, states: dict) -> None:
        """Set each scheduled token's row, writing the rows of contents not resident yet.

        Tokens are laid out as vLLM lays them: the input batch's requests in order, each its
        ``scheduled[i]`` tokens at positions ``computed[i]`` onwards.
        """
        plan = []
        offset = 0
        for i, request_id in enumerate(request_ids):
            rows = self.request(request_id, states[request_id])
            if rows is not None:
                plan.append((offset, int(computed[i]), int(scheduled[i]), rows))
            offset += int(scheduled[i])
        if not plan and not self.written:
            return
        needed = {named for *_, rows in plan for named in self._keys(rows)}
        row = {named: self._resident(named, needed) for named in needed}
        target = self.host_rows_np
        dirty = max(offset, self.written)  # rows beyond this step's tokens (padding) must read row 0 too
        target[:dirty] = 0
        for start, position, count, rows in plan:
            self._mark(target, start, position, count, rows, row)
        self.written = offset if plan else 0
        if self.host_rows is not self.buffers.row_of_token:
            # An in-place write into the index the compiled graph (and its CUDA graphs) read: never a new tensor.
            self.buffers.row_of_token[:dirty].copy_(self.host_rows[:dirty], non_blocking=True)

    @staticmethod
    def _keys(rows: RequestRows) -> list[tuple]:
        return [named for named in (rows.prompt, rows.generated, *rows.listed.values()) if named is not None]

    def _mark(self, target: np.ndarray, start: int, position: int, count: int, rows: RequestRows, row: dict) -> None:
        """Rows of one request's ``count`` tokens from ``position``, laid out from ``start``."""
        length = rows.tokens.prompt_length
        end = position + count
        prompt_end = min(end, length)
        if position < prompt_end:
            if rows.prompt is not None:
                target[start : start + prompt_end - position] = row[rows.prompt]
            for listed, named in rows.listed.items():
                if position <= listed < prompt_end and named is not None:
                    target[start + listed - position] = row[named]
        if end > length and rows.generated is not None:
            first = max(position, length)
            target[start + first - position : start + count] = row[rows.generated]

    def _resident(self, named: tuple, needed: set) -> int:
        """The row holding ``named``'s content, written into a free or least recently used row if need be."""
        if named in self.row_of_key:
            self.row_of_key.move_to_end(named)
            return self.row_of_key[named]
        if self.free_rows:
            row = self.free_rows.pop()
        else:
            evicted = next(key for key in self.row_of_key if key not in needed)
            row = self.row_of_key.pop(evicted)
        content, params = row_content(self.contents[named], self.num_layers + 1, self.hidden, self.directions)
        if self.host_contents is None:
            self.buffers.table[:, row].copy_(content)
            self.buffers.params[:, row].copy_(params)
        else:
            self.host_contents[row].copy_(content)
            self.host_params[row].copy_(params)
            self.buffers.table[:, row].copy_(self.host_contents[row], non_blocking=True)
            self.buffers.params[:, row].copy_(self.host_params[row], non_blocking=True)
        self.row_of_key[named] = row
        self.row_writes += 1
        return row

    def stats(self) -> dict[str, Any]:
        """What a test or benchmark reads: eager runs of the operation, rows, and vLLM's compile counters."""
        from torch._dynamo.utils import counters
        from vllm.compilation.counter import compilation_counter

        return {
            "eager_calls": self.buffers.eager_calls,
            "rows": self.buffers.table.shape[1],
            "resident_rows": len(self.row_of_key),
            "row_writes": self.row_writes,
            "live_requests": len(self.requests),
            "compilation": dataclasses.asdict(compilation_counter),
            "dynamo_unique_graphs": counters["stats"]["unique_graphs"],
        }
