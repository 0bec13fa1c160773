"""In-engine capture: standardized values kept by one static operation each, inside vLLM's compiled model.

An engine built to keep some values (`capture_settings`; their names ride ``additional_config``, so they also
key vLLM's compile cache) has, on its worker, one ``rows [values, max_num_batched_tokens, hidden]`` buffer (the
memory model's ``capture buffer``) and, at each kept value's location, a hook that copies the step's ``[tokens,
hidden]`` stream into its row of the buffer with `keep_rows`: a custom op the compiled graph calls in place (no
copy of the whole buffer, no graph break, captured into CUDA graphs on GPUs). The locations are found through the
model's family in ``families/vllm/`` by the descriptors nnsight reads (`Value.located`), so both paths read the
same values.

Before each step the runner lays out which scheduled tokens each capturing request keeps (`Capturer.plan`, from the
scheduler's output, as the steering table is filled); after the forward it hands those rows on to the request's own
tensors, one piece per value per run of a request's tokens (`kept_delivery.Piece`), by position: chunked prefill,
requests joining and leaving, and a preempted request computed again keep each row once, in position order. On the
CPU the rows are handed on at once, from the buffer; from an accelerator only the rows some request keeps leave the
device, without a host sync (`kept_delivery.RowsLeaving`): gathered on the compute stream into a compact buffer by a
per-step index, then copied to pinned host memory by a writer thread, a bounded part at a time on a copy stream of
its own, and handed on from there, overlapped with the engine's next steps. The client takes a finished request's
tensors in one call (`Capturer.take`, once every row sent is written); they never travel through the engine's output
queue. Under tensor parallelism the stream is whole on every rank, so only the first rank keeps rows.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ... import families
from ...specs.capture import EXTRA_ARGS_KEY, kept_count, kept_runs
from .kept_delivery import KeptRows, RowsLeaving, hand_on
from .memory import Ledger
from .placement import graph_op, locate, runs
from .sae_encoding import DeviceSAE
from .shared_rows import INTO, Region, open_region
from .tensor_wire import pack

logger = logging.getLogger(__name__)

#: Key of the engine's steering settings under which the kept values' names travel.
CAPTURE_SETTING = "capture"
#: Finished requests whose rows the worker holds for the client before dropping the oldest.
FINISHED_KEPT = 4096


@graph_op(mutates="rows")
def keep_rows(rows: torch.Tensor, slot: int, value: torch.Tensor) -> None:
    """Copy a step's ``value`` (``[tokens, hidden]``) into ``rows[slot]``: the one operation capture adds to
    the compiled graph (`graph_op`)."""
    rows[slot, : value.shape[0]].copy_(value)


class CaptureRows(torch.nn.Module):
    """The per-step buffer of kept values, ``rows [values, tokens, hidden]`` (the memory model's ``capture
    buffer``), registered on every hooked module (a non-persistent buffer: no weight file names it) so the compiled
    graph reads it at a stable path."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.register_buffer("rows", ledger.allocate("capture buffer"), False)
        #: How many times a hook writing these buffers ran as Python rather than inside a compiled graph.
        self.eager_calls = 0
        #: Whether the step being run keeps no row (`Capturer.plan`): an eager step then skips the hooks (`runs`).
        self.idle = True


def keep_output(module: torch.nn.Module, args: Any, output: Any) -> None:
    """Forward hook: each value kept at this module's output, copied into its row of the buffer."""
    if runs(module.nnterp_capture):
        for slot, flat in module.nnterp_kept_outputs:
            torch.ops.nnterp_vllm.keep_rows(module.nnterp_capture.rows, slot, flat(output))


def keep_input(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
    """Forward pre-hook: each value kept at this module's input, copied into its row of the buffer."""
    if runs(module.nnterp_capture):
        for slot, flat in module.nnterp_kept_inputs:
            torch.ops.nnterp_vllm.keep_rows(module.nnterp_capture.rows, slot, flat((args, kwargs)))


def keeps_rows() -> bool:
    """Whether this worker keeps captured rows: only the first tensor-parallel rank does, the streams being whole
    on every rank (call inside a worker, where vLLM's parallel groups exist)."""
    from vllm.distributed import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() == 0


class Capturer:
    """Installs the capture operations on a loaded model, lays out each step's kept rows and copies them out."""

    def __init__(
        self,
        model: torch.nn.Module,
        vllm_config: Any,
        names: Sequence[str],
        ledger: Ledger,
        saes: dict[int, DeviceSAE],
        encoding: torch.Tensor | None,
    ) -> None:
        model_config = vllm_config.model_config
        self.names = list(names)
        self.slots = {name: slot for slot, name in enumerate(self.names)}
        found = locate(model, families.model_type(model_config.hf_config), self.names)
        #: Why a value named at build cannot be kept (what the client refuses with).
        self.reasons = {name: where for name, where in found.items() if isinstance(where, str)}
        #: Where each kept value lives: ``(module path, hook point)``.
        self.places = {
            name: (where.module, where.attribute) for name, where in found.items() if name not in self.reasons
        }
        self.keeps = keeps_rows()
        #: The SAEs the engine holds on its device (whose features captures encode from the rows kept), by the
        #: block they read, and the buffer their features are encoded into.
        self.saes, self.encoding = saes, encoding
        self.hidden = model_config.get_hidden_size()
        self.requests: dict[str, KeptRows | None] = {}
        #: Destinations mapped here (`shared_rows`), by id: the region and how many requests write into it.
        self.regions: dict[str, list[Any]] = {}
        self.finished: collections.OrderedDict[str, KeptRows] = collections.OrderedDict()
        #: The finished requests whose rows this worker holds in its own memory (at most `FINISHED_KEPT`), oldest first.
        self.in_memory: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: Why each destination this worker could not open was not (the latest `FINISHED_KEPT`), by id.
        self.unopened: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.step: list[tuple[KeptRows, int, int, int]] = []
        self.step_tokens = 0
        self.rows_kept = 0
        self.buffers: CaptureRows | None = None
        self.leaving: RowsLeaving | None = None
        if "capture buffer" not in ledger or self.reasons:
            return
        self.buffers = CaptureRows(ledger)
        device = torch.device(ledger.device)
        if device.type != "cpu":
            self.leaving = RowsLeaving(self.buffers.rows, ledger, torch.get_device_module(device))
        for name, where in found.items():
            module = model.get_submodule(where.module)
            if not hasattr(module, "nnterp_capture"):
                module.nnterp_capture = self.buffers
                module.nnterp_kept_outputs, module.nnterp_kept_inputs = [], []
            if where.attribute == "output":
                if not module.nnterp_kept_outputs:
                    module.register_forward_hook(keep_output)
                module.nnterp_kept_outputs.append((self.slots[name], where.flat))
            else:
                if not module.nnterp_kept_inputs:
                    module.register_forward_pre_hook(keep_input, with_kwargs=True)
                module.nnterp_kept_inputs.append((self.slots[name], where.flat))

    # -- requests -------------------------------------------------------------------------------------

    def request(self, request_id: str, state: Any) -> KeptRows | None:
        """The capture of a scheduled request (set up once, from its sampling params)."""
        if request_id in self.requests:
            return self.requests[request_id]
        wire = (getattr(state.sampling_params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY)
        kept = None
        if wire is not None and self.keeps:
            dtype = getattr(torch, wire["dtype"])
            slots = [self.slots[name] for name in wire["values"]]
            region = self._region(wire[INTO], dtype) if INTO in wire else None
            if region is not None:
                first = wire[INTO]["first"]
                count = kept_count(wire, wire["prompt_tokens"] + max(0, (state.sampling_params.max_tokens or 1) - 1))
                capacity = max(0, min(count, region.rows - first))
                kept = KeptRows(wire, slots, [], region=region, first=first, capacity=capacity)
            else:
                expected = wire["prompt_tokens"] + max(0, (state.sampling_params.max_tokens or 1) - 1)
                capacity = max(1, min(kept_count(wire, expected), wire["prompt_tokens"] + 16))
                kept = KeptRows(wire, slots, [torch.empty(capacity, self.hidden, dtype=dtype) for _ in wire["values"]])
        self.requests[request_id] = kept
        return kept

    def _region(self, into: dict[str, Any], dtype: torch.dtype) -> Region | None:
        """The destination ``into`` names, opened once while requests write into it (`release` lets go); ``None``
        where it cannot be opened here (why is kept, and logged once per destination, `unopened`)."""
        held = self.regions.get(into["id"])
        if held is None:
            region = open_region(into, dtype)
            if not isinstance(region, Region):
                if into["id"] not in self.unopened:
                    self.unopened[into["id"]] = region or "it could not be opened"
                    while len(self.unopened) > FINISHED_KEPT:
                        self.unopened.popitem(last=False)
                    logger.warning("captured rows kept in the worker: their destination %s", self.unopened[into["id"]])
                return None
            held = self.regions[into["id"]] = [region, 0]
        held[1] += 1
        return held[0]

    def release(self, kept: KeptRows) -> None:
        """A request writing into a region is done with it: the last one lets go of it (call once every row sent
        is written: `settle`)."""
        if kept.region is None:
            return
        key = kept.wire[INTO]["id"]
        held = self.regions[key]
        held[1] -= 1
        if held[1] == 0:
            del self.regions[key]
            held[0].close()

    def forget(self, request_id: str) -> None:
        """A request left the engine (finished or aborted): its rows wait for the client, those held in this
        worker's memory (not in a destination) within a bound past which the oldest are dropped, loudly (a client
        writing to a destination refuses the shard missing them)."""
        kept = self.requests.pop(request_id, None)
        if kept is None or kept.taken:
            return
        entry = f"{kept.wire['key']}/{request_id}"
        self.finished[entry] = kept
        if kept.region is not None:
            return  # its rows lie in its destination: nothing held here but the destination, until taken
        self.in_memory[entry] = None
        while len(self.in_memory) > FINISHED_KEPT:
            self.settle()
            dropped, _ = self.in_memory.popitem(last=False)
            kept = self.finished.pop(dropped)
            self.release(kept)
            why = self.unopened.get(kept.wire[INTO]["id"]) if INTO in kept.wire else None
            # A client writing rows to a destination (a harvest's shard) finds them missing and refuses the shard.
            logger.error(
                "captured rows of request %s were never taken within %d finished requests; dropped%s",
                dropped,
                FINISHED_KEPT,
                f" (their destination {why})" if why else "",
            )

    # -- per step -------------------------------------------------------------------------------------

    def plan(self, request_ids: Sequence[str], scheduled: np.ndarray, computed: np.ndarray, states: dict) -> None:
        """Lay out the rows this step keeps: tokens as vLLM lays them, the input batch's requests in order, each
        its ``scheduled[i]`` tokens at positions ``computed[i]`` onwards."""
        self.step = []
        offset = 0
        for i, request_id in enumerate(request_ids):
            count = int(scheduled[i])
            kept = self.request(request_id, states[request_id])
            if kept is not None and not kept.taken:
                for first, row, length in kept_runs(kept.wire, int(computed[i]), count):
                    self.step.append((kept, offset + first, row, length))
            offset += count
        self.step_tokens = offset
        if self.buffers is not None:
            self.buffers.idle = not self.step

    def gather(self) -> None:
        """Send this step's kept rows on their way to their requests' tensors (at once on the CPU; from an
        accelerator, asynchronously: `RowsLeaving`), and hand on those of earlier steps that have arrived."""
        if self.leaving is not None:
            self.leaving.deliver(wait=False)
        if not self.step:
            return
        if self.leaving is None:
            hand_on(self.buffers.rows, self.step)
        else:
            self.leaving.send(self.step, self.step_tokens)
        self.rows_kept += sum(length for *_, length in self.step)
        self.step = []

    def take(self, keys: Sequence[str], packed: bool) -> dict[str, dict[str, dict[str, Any]]]:
        """The rows of the requests carrying capture ``keys``: ``{key: {request id: {value name: [kept, hidden]}}}``
        (one request id per completion; ``None`` for one whose rows lie in its destination, `shared_rows`), handed
        over and forgotten here; each tensor `packed` where the rows leave this process (an RPC result crosses
        processes as plain data)."""
        self.settle()
        wanted = set(keys)
        found: dict[str, dict[str, Any]] = {}
        for entry, kept in list(self.finished.items()):
            key, request_id = entry.split("/", 1)
            if key in wanted:
                found.setdefault(key, {})[request_id] = kept.handed_back(self.saes, self.encoding)
                del self.finished[entry]
                self.in_memory.pop(entry, None)
                self.release(kept)
        for request_id, kept in self.requests.items():
            if kept is not None and not kept.taken and kept.wire["key"] in wanted:
                found.setdefault(kept.wire["key"], {})[request_id] = kept.handed_back(self.saes, self.encoding)
                kept.taken = True
                self.release(kept)
        if packed:
            for requests in found.values():
                for named in requests.values():
                    if named is not None:
                        named.update({name: pack(rows) for name, rows in named.items()})
        return found

    def settle(self) -> None:
        """Wait until every row sent from the accelerator is written (`RowsLeaving`), before rows are read or let
        go of."""
        if self.leaving is not None:
            self.leaving.deliver(wait=True)

    def close(self) -> None:
        """Write every row sent and stop the writer thread, as the engine shuts down."""
        if self.leaving is not None:
            self.leaving.close()

    def stats(self) -> dict[str, Any]:
        """What a test or benchmark reads: eager runs of the capture hooks, rows kept, requests held."""
        return {
            "eager_calls": self.buffers.eager_calls if self.buffers is not None else 0,
            "rows_kept": self.rows_kept,
            "live_requests": sum(kept is not None for kept in self.requests.values()),
            "finished_held": len(self.finished),
            "steps_on_the_way": self.leaving.pending if self.leaving is not None else 0,
            "rows_moved_off_the_device": self.leaving.moved if self.leaving is not None else 0,
            "regions_mapped": len(self.regions),
        }


__all__ = ["Capturer", "keep_rows", "keeps_rows"]
