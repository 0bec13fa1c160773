"""The steering table of the steered engine, on its worker: one static operation at every standardized block.

At every standardized block's ``layer_output`` (located through the model's family in ``families/vllm/``, so
exactly where `Standardized.steer` adds) a forward hook adds ``table[layer, row_of_token, 0]`` and then clamps the
stream's projection on each direction ``table[layer, row_of_token, d]`` (d = 1 .. `DIRECTIONS_PER_BLOCK`) to
``bounds[layer, row_of_token, d - 1]``: ``table`` is a ``[layers + 1, rows, 1 + directions, hidden]`` buffer,
``bounds`` ``[layers + 1, rows, directions, 2]`` (row 0 adds nothing and clamps nothing: a zero direction's
projection is zero, inside any bounds), ``row_of_token`` a ``[max_num_batched_tokens]`` index. Adding, ablating
and capping are the one operation: a row that only adds holds zero directions, an ablation is a cap to ``[0, 0]``.
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
from ..steering.specs import (
    DIRECTIONS_PER_BLOCK,
    EVERYWHERE,
    EVERYWHERE_VALUES,
    EXTRA_ARGS_KEY,
    TokenSets,
    projection_change,
    token_sets,
)
from .capture import count_eager_run, locate
from .steered_settings import CONFIG_KEY

# -- worker side --------------------------------------------------------------------------------------


class SteeringTable(torch.nn.Module):
    """The per-step steering buffers: ``table [layers, rows, 1 + directions, hidden]`` (each row's added vector,
    then its directions), ``bounds [layers, rows, directions, 2]`` (row 0 adds and clamps nothing) and
    ``row_of_token``.

    Registered on every steered block (non-persistent buffers: no weight file names them), so the
    compiled graph reads them as inputs at stable module paths; they are only ever written in place.
    """

    def __init__(self, layers: int, rows: int, tokens: int, hidden: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        slots = 1 + DIRECTIONS_PER_BLOCK
        with torch.inference_mode(False):
            self.register_buffer("table", torch.zeros(layers, rows, slots, hidden, dtype=dtype, device=device), False)
            self.register_buffer("bounds", unbounded(layers, rows, device), False)
            self.register_buffer("row_of_token", torch.zeros(tokens, dtype=torch.long, device=device), False)
        #: How many times the steering operation ran as Python rather than inside a compiled graph.
        self.eager_calls = 0

    @property
    def everywhere(self) -> int:
        """The table's entry of the directions ablated at every residual-stream location."""
        return self.table.shape[0] - 1

    def steered(self, layer: int, stream: torch.Tensor) -> torch.Tensor:
        """What to add to ``stream`` (``[tokens, hidden]``, or ``[1, tokens, hidden]``) at table entry ``layer``
        (each token's vector, then each of its directions' projection clamped to its bounds, in order); pure
        tensor code."""
        rows = self.row_of_token[: stream.shape[-2]]
        slots = self.table[layer].index_select(0, rows)
        bounds = self.bounds[layer].index_select(0, rows)
        delta = slots[:, 0]
        for slot in range(DIRECTIONS_PER_BLOCK):
            delta = delta + projection_change(
                stream + delta, slots[:, 1 + slot], bounds[:, slot, 0], bounds[:, slot, 1]
            )
        return delta


def unbounded(layers: int, rows: int, device: Any = "cpu") -> torch.Tensor:
    """``[layers, rows, directions, 2]`` bounds that clamp nothing: ``(-inf, inf)``."""
    bounds = torch.empty(layers, rows, DIRECTIONS_PER_BLOCK, 2, dtype=torch.float32, device=device)
    bounds[..., 0], bounds[..., 1] = -torch.inf, torch.inf
    return bounds


def row_content(specs: Sequence[dict[str, Any]], entries: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One table row's content from the specs (engine form) it applies, in order: ``[entries, 1 + directions,
    hidden]`` (the summed added vectors, then each cap's direction in the next free slot of its layers; the last
    entry for the directions ablated everywhere) and ``[entries, directions, 2]`` bounds (``-inf`` / ``inf``
    where a bound is left out)."""
    content = torch.zeros(entries, 1 + DIRECTIONS_PER_BLOCK, hidden, dtype=torch.float32)
    bounds = unbounded(entries, 1)[:, 0]
    used = [0] * entries
    for spec in specs:
        vector = torch.tensor(spec["vector"], dtype=torch.float32)
        for layer in [entries - 1] if spec["layers"] == EVERYWHERE else spec["layers"]:
            if spec["kind"] == "add":
                content[layer, 0] += spec["factor"] * vector
                continue
            used[layer] += 1
            content[layer, used[layer]] = vector
            low, high = spec["min"], spec["max"]
            bounds[layer, used[layer] - 1] = torch.tensor(
                [-torch.inf if low is None else low, torch.inf if high is None else high]
            )
    return content, bounds


def table_rows(vllm_config: Any) -> int:
    """Rows of an engine's steering table: row 0 (zeros) and room for every scheduled request's distinct rows."""
    scheduler = vllm_config.scheduler_config
    per_request = vllm_config.additional_config[CONFIG_KEY]["rows_per_request"]
    return 1 + min(scheduler.max_num_batched_tokens, per_request * scheduler.max_num_seqs)


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

    def __init__(self, model: torch.nn.Module, vllm_config: Any, device: torch.device) -> None:
        model_config, scheduler = vllm_config.model_config, vllm_config.scheduler_config
        blocks = steered_blocks(model, Standardized._model_type(model_config.hf_config))
        if len(blocks) != model_config.hf_text_config.num_hidden_layers:
            raise UnsupportedFamily(
                f"found {len(blocks)} blocks in {type(model).__name__}, but its config has "
                f"num_hidden_layers={model_config.hf_text_config.num_hidden_layers}"
            )
        hidden = model_config.get_hidden_size()
        tokens = scheduler.max_num_batched_tokens
        rows = table_rows(vllm_config)
        self.buffers = SteeringTable(len(blocks) + 1, rows, tokens, hidden, model_config.dtype, device)
        for index, (block, value) in enumerate(blocks):
            block.nnterp_steering = self.buffers
            block.nnterp_layer = index
            block.nnterp_layer_output = value
            block.register_forward_hook(steer_block)
        self.num_layers, self.hidden = len(blocks), hidden
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
        slots = 1 + DIRECTIONS_PER_BLOCK
        entries = len(blocks) + 1
        self.host_contents = (
            None if on_host else torch.zeros(rows, entries, slots, hidden, dtype=model_config.dtype, pin_memory=True)
        )
        self.host_bounds = None if on_host else unbounded(rows, entries).pin_memory()
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
        content, bounds = row_content(self.contents[named], self.num_layers + 1, self.hidden)
        if self.host_contents is None:
            self.buffers.table[:, row].copy_(content)
            self.buffers.bounds[:, row].copy_(bounds)
        else:
            self.host_contents[row].copy_(content)
            self.host_bounds[row].copy_(bounds)
            self.buffers.table[:, row].copy_(self.host_contents[row], non_blocking=True)
            self.buffers.bounds[:, row].copy_(self.host_bounds[row], non_blocking=True)
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
