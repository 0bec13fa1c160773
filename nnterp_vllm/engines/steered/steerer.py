"""The steering operation's worker side: `Steerer` installs the steering table's operation on a loaded model (at
every standardized block's output, and at the pool's other locations the family can write) and, before each step,
writes into the table the content of entries, rows and probe columns it does not hold yet and each scheduled token's
row; on an accelerator through pinned host memory (`Staging`), copied over without blocking.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ... import families
from ...components import vllm as on_vllm
from ...components.values import Located
from ...errors import UnsupportedFamily
from ...specs.probes import EXTRA_ARGS_KEY as PROBES_KEY
from ...specs.steering import STEERING_VALUES
from ...specs.steering_requests import EXTRA_ARGS_KEY
from .memory import Ledger
from .placement import locate
from .sae_encoding import DeviceSAE
from .steering_pool import PLACED, location
from .steering_table import SteeringTable, entry_content, steer_at_input, steer_at_output, steer_block


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
    """A steered request, as the worker keeps it: the row of each of its token sets (0: none) and which of its
    rows clamp a TopK SAE's feature (their steps run eagerly)."""

    prompt_length: int
    prompt: int
    generated: int
    listed: dict[int, int]
    topk_rows: frozenset[int]


class Steerer:
    """Installs the steering operation on a loaded model and fills its buffers before each step."""

    def __init__(
        self,
        model: torch.nn.Module,
        vllm_config: Any,
        ledger: Ledger,
        topk: dict[int, DeviceSAE],
        encoding: torch.Tensor | None,
        steering_values: Sequence[str] = STEERING_VALUES,
    ) -> None:
        model_config = vllm_config.model_config
        model_type = families.model_type(model_config.hf_config)
        blocks = steered_blocks(model, model_type)
        if len(blocks) != model_config.hf_text_config.num_hidden_layers:
            raise UnsupportedFamily(
                f"found {len(blocks)} blocks in {type(model).__name__}, but its config has "
                f"num_hidden_layers={model_config.hf_text_config.num_hidden_layers}"
            )
        self.buffers = SteeringTable(ledger, topk, encoding)
        self.num_layers, self.hidden = len(blocks), model_config.get_hidden_size()
        self.directions = self.buffers.directions
        # An engine whose pool holds no entry and reads no probe (a harvest's) runs no steering operation at all.
        steers = self.buffers.vectors.shape[0] > 1 or self.buffers.probe_weights is not None
        #: Places the steering operation runs at in each forward (none on an engine that steers nothing).
        self.operations = len(blocks) if steers else 0
        for index, (block, value) in enumerate(blocks if steers else []):
            block.nnterp_steering = self.buffers
            block.nnterp_layer = index
            block.nnterp_layer_output = value
            block.register_forward_hook(steer_block)
        #: Why a value other than ``layer_output`` cannot be steered on this model, by value (``None``: it can).
        self.unwritable = self._hook_locations(model, model_type, steers, steering_values)
        # On an accelerator the token rows and each new entry's and row's content are written into pinned host
        # memory (the memory model's "... written" buffers) and copied over without blocking, on the compute
        # stream, before the step's forward. `fill` runs inside vLLM's input preparation, which (under async
        # scheduling) waits for the previous step's copies to have left those host buffers before it starts
        # (``synchronize_input_prep``), and otherwise follows the previous step's synchronized output.
        device = torch.device(ledger.device)
        self.staged = None if device.type == "cpu" else Staging(ledger)
        self.host_rows = self.buffers.token_rows if self.staged is None else self.staged.token_rows
        self.host_rows_np = self.host_rows.numpy()
        self.written = 0
        self.requests: dict[str, RequestRows | None] = {}
        #: What each entry and row holds (the key of its content), to write only content not held yet.
        self.entry_keys: dict[int, str] = {}
        self.row_keys: dict[int, str] = {}
        self.column_keys: dict[int, str] = {}
        #: Rows whose entries clamp a TopK SAE's feature at a block where the engine holds that SAE.
        self.topk_rows: set[int] = set()
        self.row_writes = 0
        self.entry_writes = 0
        #: Whether the step being prepared must run eagerly (a token in it clamps a TopK SAE's feature).
        self.eager = False

    def _hook_locations(
        self, model: torch.nn.Module, model_type: str, steers: bool, steering_values: Sequence[str]
    ) -> dict[str, str | None]:
        """Hook the pool's locations beside the blocks' outputs (what each attention and MLP adds, the stream entering
        the first block: `steering_pool.location`) that are among ``steering_values``, located through the family as
        capture locates values, where the engine ``steers``. A value the family cannot write at some block, or the
        engine was built not to act at, is hooked at none: its reason, by value."""
        reasons: dict[str, str | None] = {}
        for value, layers in (
            ("attention_output", self.num_layers),
            ("mlp_output", self.num_layers),
            ("layer_input", 1),
        ):
            if value not in steering_values:
                reasons[value] = (
                    f"the engine is built to steer {', '.join(steering_values)} only (steering_values); build it "
                    f"with {value!r} among them"
                )
                continue
            names = {f"layers.{i}.{value}": location(value, i, self.num_layers) for i in range(layers)}
            found = locate(model, model_type, list(names))
            reasons[value] = next(
                (
                    f"this family cannot write {name}: {place if isinstance(place, str) else 'it is read-only there'}"
                    for name, place in found.items()
                    if isinstance(place, str) or place.replaced is None
                ),
                None,
            )
            if reasons[value] is None and steers:
                for name, place in found.items():
                    self._hook(model.get_submodule(place.module), names[name], place)
        return reasons

    def _hook(self, module: torch.nn.Module, at: int, place: Located) -> None:
        """Apply location ``at``'s entries where ``place`` (a module's output or input) is."""
        module.nnterp_steering = self.buffers
        kind = "outputs" if place.attribute == "output" else "inputs"
        if not hasattr(module, f"nnterp_steered_{kind}"):
            setattr(module, f"nnterp_steered_{kind}", [])
            if kind == "outputs":
                module.register_forward_hook(steer_at_output)
            else:
                module.register_forward_pre_hook(steer_at_input, with_kwargs=True)
        getattr(module, f"nnterp_steered_{kind}").append((at, place))
        self.operations += 1

    # -- requests -------------------------------------------------------------------------------------

    def request(self, request_id: str, state: Any) -> RequestRows | None:
        """The steering of a scheduled request, its pool content written where this worker does not hold it yet
        (once, the first time the request is scheduled)."""
        if request_id in self.requests:
            return self.requests[request_id]
        extra = getattr(state.sampling_params, "extra_args", None) or {}
        wire = extra.get(EXTRA_ARGS_KEY)
        rows = None
        probes = extra.get(PROBES_KEY)
        if probes is not None:
            self.place_columns(probes[PLACED]["columns"])
        if wire is not None:
            placed = wire[PLACED]
            self.place_columns(placed["columns"])
            for entry, key, applied, gates in placed["entries"]:
                if self.entry_keys.get(entry) != key:
                    gated = dict(gates)
                    self._write_entry(entry, [wire["specs"][i] for i in applied], [gated.get(i) for i in applied])
                    self.entry_keys[entry] = key
            topk_entries = {
                entry
                for entry, _, applied, _ in placed["entries"]
                if any(wire["specs"][i].get("topk") for i in applied)
            }
            topk_rows = set()
            for row, key, at in placed["rows"]:
                if self.row_keys.get(row) != key:
                    self._write_row(row, at)
                    self.row_keys[row] = key
                if any(entry in topk_entries and layer in self.buffers.topk for layer, entry in at):
                    topk_rows.add(row)
            listed = {position: row for position, row in placed["listed"]}
            rows = RequestRows(
                wire["prompt_tokens"], placed["prompt"], placed["generated"], listed, frozenset(topk_rows)
            )
        self.requests[request_id] = rows
        return rows

    def place_columns(self, columns: list[list[Any]]) -> None:
        """Write the probe columns a request reads (``[id, key, block, weights, bias]`` each) where this worker does
        not hold them yet."""
        for column, key, layer, weight, bias in columns:
            if self.column_keys.get(column) != key:
                content = torch.tensor(weight, dtype=torch.float32)
                if self.staged is None:
                    self.buffers.probe_weights[column].copy_(content)
                    self.buffers.probe_bias[column], self.buffers.probe_blocks[column] = bias, layer
                else:
                    self.staged.column(self.buffers, column, content, bias, layer)
                self.column_keys[column] = key

    def _write_entry(self, entry: int, specs: list[dict[str, Any]], gates: list[int | None]) -> None:
        content, parameters, keep, relative = entry_content(specs, self.hidden, self.directions, gates)
        if self.staged is None:
            self.buffers.vectors[entry].copy_(content)
            self.buffers.params[entry].copy_(parameters)
            self.buffers.keep[entry] = keep
            self.buffers.relative[entry] = relative
        else:
            self.staged.entry(self.buffers, entry, content, parameters, keep, relative)
        self.entry_writes += 1

    def _write_row(self, row: int, at: list[list[int]]) -> None:
        content = torch.zeros(self.buffers.rows.shape[0], dtype=torch.int32)
        for layer, entry in at:
            content[layer] = entry
        if self.staged is None:
            self.buffers.rows[:, row].copy_(content)
        else:
            self.staged.row(self.buffers, row, content)
        self.row_writes += 1

    def forget(self, request_id: str) -> None:
        """Drop a finished request (the scheduler gives its rows and entries back; their content stays here until
        it places other content at them)."""
        self.requests.pop(request_id, None)

    # -- per step -------------------------------------------------------------------------------------

    def fill(
        self, request_ids: Sequence[str], scheduled: np.ndarray, computed: np.ndarray, states: dict, probing: bool
    ) -> None:
        """Set each scheduled token's row, writing the content of rows and entries not held yet, and whether the
        step runs eagerly (`eager`); the operation is idle in an eager step where no token is steered and none is
        ``probing`` (a probe's score kept this step, `probe_reads.ProbeReader.plan`).

        Tokens are laid out as vLLM lays them: the input batch's requests in order, each its
        ``scheduled[i]`` tokens at positions ``computed[i]`` onwards.
        """
        if self.staged is not None:
            self.staged.new_step()
        plan = []
        offset = 0
        for i, request_id in enumerate(request_ids):
            rows = self.request(request_id, states[request_id])
            if rows is not None:
                plan.append((offset, int(computed[i]), int(scheduled[i]), rows))
            offset += int(scheduled[i])
        self.eager = False
        self.buffers.idle = not plan and not probing
        if not plan and not self.written:
            return
        target = self.host_rows_np
        dirty = max(offset, self.written)  # rows beyond this step's tokens (padding) must read row 0 too
        target[:dirty] = 0
        for start, position, count, rows in plan:
            self.eager |= self._mark(target, start, position, count, rows)
        self.written = offset if plan else 0
        if self.host_rows is not self.buffers.token_rows:
            # An in-place write into the index the compiled graph (and its CUDA graphs) read: never a new tensor.
            self.buffers.token_rows[:dirty].copy_(self.host_rows[:dirty], non_blocking=True)

    @staticmethod
    def _mark(target: np.ndarray, start: int, position: int, count: int, rows: RequestRows) -> bool:
        """Rows of one request's ``count`` tokens from ``position``, laid out from ``start``; whether one of the rows
        marked clamps a TopK SAE's feature."""
        length = rows.prompt_length
        end = position + count
        prompt_end = min(end, length)
        marked = set()
        if position < prompt_end:
            if rows.prompt:
                target[start : start + prompt_end - position] = rows.prompt
                marked.add(rows.prompt)
            for listed, row in rows.listed.items():
                if position <= listed < prompt_end and row:
                    target[start + listed - position] = row
                    marked.add(row)
        if end > length and rows.generated:
            first = max(position, length)
            target[start + first - position : start + count] = rows.generated
            marked.add(rows.generated)
        return bool(marked & rows.topk_rows)

    def stats(self) -> dict[str, Any]:
        """What a test or benchmark reads: eager runs of the operation, the places it runs at, the pool's size and
        writes, and vLLM's compile counters."""
        from torch._dynamo.utils import counters
        from vllm.compilation.counter import compilation_counter

        return {
            "eager_calls": self.buffers.eager_calls,
            "operations": self.operations,
            "entries": self.buffers.vectors.shape[0] - 1,
            "rows": self.buffers.rows.shape[1] - 1,
            "entry_writes": self.entry_writes,
            "row_writes": self.row_writes,
            "live_requests": len(self.requests),
            "compilation": dataclasses.asdict(compilation_counter),
            "dynamo_unique_graphs": counters["stats"]["unique_graphs"],
        }


class Staging:
    """The pinned host memory a step's new steering content is written through on an accelerator (the memory
    model's ``steering ... written`` buffers): each write takes the next staging slot and is copied to its place
    without blocking; a step writing more than the staging holds (the scheduler admits more only for one request
    alone) waits for its earlier copies before reusing a slot."""

    def __init__(self, ledger: Ledger) -> None:
        self.vectors = ledger.allocate("steering vectors written")
        self.parameters = ledger.allocate("steering parameters written")
        self.keep = ledger.allocate("steering keep written")
        self.relative = ledger.allocate("steering relative written")
        probes = "probe weights written" in ledger
        self.columns = ledger.allocate("probe weights written") if probes else None
        self.column_bias = ledger.allocate("probe bias written") if probes else None
        self.column_blocks = ledger.allocate("probe blocks written") if probes else None
        self.rows = ledger.allocate("steering rows written")
        self.token_rows = ledger.allocate("steering token rows written")
        self.device = torch.get_device_module(ledger.device)
        self.used = {"entries": 0, "rows": 0, "columns": 0}

    def new_step(self) -> None:
        """A step's writes begin: every staging slot is free (vLLM's input preparation waited for the last step's
        copies)."""
        self.used = {"entries": 0, "rows": 0, "columns": 0}

    def _slot(self, kind: str, capacity: int) -> int:
        if self.used[kind] == capacity:
            done = self.device.Event()
            done.record()
            done.synchronize()
            self.used = {"entries": 0, "rows": 0, "columns": 0}
        slot = self.used[kind]
        self.used[kind] += 1
        return slot

    def entry(
        self,
        table: SteeringTable,
        entry: int,
        content: torch.Tensor,
        parameters: torch.Tensor,
        keep: float,
        relative: float,
    ) -> None:
        """Write an entry's content to ``table`` through the staging."""
        slot = self._slot("entries", self.vectors.shape[0])
        self.vectors[slot].copy_(content)
        self.parameters[slot].copy_(parameters)
        self.keep[slot] = keep
        self.relative[slot] = relative
        table.vectors[entry].copy_(self.vectors[slot], non_blocking=True)
        table.params[entry].copy_(self.parameters[slot], non_blocking=True)
        table.keep[entry : entry + 1].copy_(self.keep[slot : slot + 1], non_blocking=True)
        table.relative[entry : entry + 1].copy_(self.relative[slot : slot + 1], non_blocking=True)

    def column(self, table: SteeringTable, column: int, weight: torch.Tensor, bias: float, layer: int) -> None:
        """Write a probe column (its weights, bias and block) to ``table`` through the staging."""
        slot = self._slot("columns", self.columns.shape[0])
        self.columns[slot].copy_(weight)
        self.column_bias[slot], self.column_blocks[slot] = bias, layer
        table.probe_weights[column].copy_(self.columns[slot], non_blocking=True)
        table.probe_bias[column : column + 1].copy_(self.column_bias[slot : slot + 1], non_blocking=True)
        table.probe_blocks[column : column + 1].copy_(self.column_blocks[slot : slot + 1], non_blocking=True)

    def row(self, table: SteeringTable, row: int, content: torch.Tensor) -> None:
        """Write a row's entries (one per block) to ``table`` through the staging."""
        slot = self._slot("rows", self.rows.shape[0])
        self.rows[slot].copy_(content)
        table.rows[:, row].copy_(self.rows[slot], non_blocking=True)


__all__ = ["RequestRows", "Staging", "Steerer", "steered_blocks"]
