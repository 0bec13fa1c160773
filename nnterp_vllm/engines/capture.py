"""In-engine capture: standardized values kept by one static operation each, inside vLLM's compiled model.

An engine built to keep some values (`capture_settings`; their names ride ``additional_config``, so they also
key vLLM's compile cache) has, on its worker, one ``rows [values, max_num_batched_tokens, hidden]`` buffer (the
memory model's ``capture buffer``) and, at each kept value's location, a hook that copies the step's ``[tokens,
hidden]`` stream into its row of the buffer with `keep_rows`: a custom op the compiled graph calls in place (no
copy of the whole buffer, no graph break, captured into CUDA graphs on GPUs). The locations are found through the
model's family in ``families/vllm/`` by the descriptors nnsight reads (`Value.located`), so both paths read the
same values.

Before each step the runner lays out which scheduled tokens each capturing request keeps (`Capturer.plan`,
from the scheduler's output, as the steering table is filled); after the forward it hands those rows on to the
request's own tensors, one piece per value per run of a request's tokens (`Piece`), by position: chunked
prefill, requests joining and leaving, and a preempted request computed again keep each row once, in position
order. On the CPU the rows are handed on at once, from the buffer; from an accelerator only the rows some request
keeps leave the device, without a host sync (`RowsLeaving`): gathered on the compute stream into a compact buffer
by a per-step index, then copied to pinned host memory by a writer thread, a bounded part at a time on a copy stream
of its own, and handed on from there, overlapped with the engine's next steps. The client takes a finished
request's tensors in one call (`Capturer.take`, once every row sent is written); they never travel through the
engine's output queue. Under tensor parallelism the stream is whole on every rank, so only the first rank keeps
rows.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .. import families
from ..capture import EXTRA_ARGS_KEY, STATIC_ROOT_VALUES, kept_count, kept_runs
from ..components import Layers
from ..components.values import Located
from ..standardized import Standardized, standard_rename
from .memory import Ledger
from .sae_encoding import DeviceSAE
from .shared_rows import INTO, Region, open_region

logger = logging.getLogger(__name__)

#: Key of the engine's steering settings under which the kept values' names travel.
CAPTURE_SETTING = "capture"
#: Finished requests whose rows the worker holds for the client before dropping the oldest.
FINISHED_KEPT = 4096


#: The library holding the operations the engines add to vLLM's compiled graph (`graph_op`).
GRAPH_OPS = torch.library.Library("nnterp_vllm", "FRAGMENT")


def graph_op(mutates: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register a function that writes its argument ``mutates`` in place as ``torch.ops.nnterp_vllm.<its name>``:
    opaque to the compiler, so the compiled graph calls it and the buffer is written where it is (no copy of it),
    and called straight through the dispatcher, as vLLM registers its own operations (`torch.library.custom_op`'s
    dispatch costs several times these small writes, paid at every block of every step)."""

    def register(function: Callable[..., None]) -> Callable[..., None]:
        name = function.__name__
        GRAPH_OPS.define(name + torch.library.infer_schema(function, mutates_args=(mutates,)))
        GRAPH_OPS.impl(name, function, "CompositeExplicitAutograd")
        torch.library.register_fake(f"nnterp_vllm::{name}", lambda *args: None, lib=GRAPH_OPS)
        return function

    return register


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


def runs(buffers: torch.nn.Module) -> bool:
    """Whether an operation on an engine's ``buffers`` runs at this call: always inside a compiled graph (traced once,
    for every step); outside one (an eager step: a trace's code or a TopK clamp in it, or an engine built eagerly)
    only where the step uses them (``buffers.idle`` false), each such run counted on ``buffers.eager_calls``."""
    if torch.compiler.is_compiling():  # folded away when traced: the operation is in the graph for every step
        return True
    if buffers.idle:
        return False
    buffers.eager_calls += 1
    return True


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


@contextlib.contextmanager
def standard_tree(model: torch.nn.Module, family: Any) -> Iterator[Any]:
    """The nnsight envoy tree over a loaded model with ``family``'s names and classes, to locate values by the
    same descriptors nnsight reads; every module gets back what building the tree installed on it (nnsight's
    controllers) on the way out, so the model vLLM compiles carries nothing of it."""
    from nnsight.intervention.envoy import Envoy
    from nnsight.intervention.source import STATE

    missing = object()
    before = [(module, module.__dict__.get("forward", missing)) for module in model.modules()]
    root = type("FamilyRoot", (Envoy,), {"family": family})  # what root values ask of their model
    try:
        yield root(model, rename=standard_rename(family), envoys={"layers": Layers, **family.ENVOYS})
    finally:
        for module, forward in before:
            module.__dict__.pop(STATE, None)
            if forward is missing:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = forward


def locate(model: torch.nn.Module, model_type: str, names: Sequence[str]) -> dict[str, Located | str]:
    """Each value name (``layers.3.layer_output``, ``token_embeddings``) -> where it lives on ``model`` and how it
    is read there (`Located`), or why the engine cannot keep it."""
    from .vllm import StandardizedVLLM

    family = families.lookup(model_type, engine=families.VLLM)
    found: dict[str, Located | str] = {}
    with standard_tree(model, family) as root:
        for name in names:
            if name in STATIC_ROOT_VALUES:
                host, descriptor = root, getattr(StandardizedVLLM, name)
            else:
                _, layer, key = name.split(".", 2)
                host = root.layers[int(layer)]
                *modules, value = key.split(".")
                for part in modules:
                    host = getattr(host, part, None)
                    if host is None:
                        break
                descriptor = getattr(type(host), value, None)
            if host is None or descriptor is None:
                found[name] = f"{family.__name__} has no {name}"
            else:
                found[name] = descriptor.located(host)
    return found


def pack(tensor: torch.Tensor) -> tuple[str, list[int], bytes]:
    """A tensor as plain data an RPC result carries across processes: dtype name, shape, raw bytes."""
    return (
        str(tensor.dtype).removeprefix("torch."),
        list(tensor.shape),
        tensor.contiguous().view(torch.uint8).numpy().tobytes(),
    )


def unpack(packed: Any) -> torch.Tensor:
    """The tensor `pack` made plain data (a tensor itself where it never left its process)."""
    if isinstance(packed, torch.Tensor):
        return packed
    dtype, shape, data = packed
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


@dataclasses.dataclass
class KeptRows:
    """A capturing request, as the runner keeps it: its capture in engine form, the buffer slot of each of its
    values, and its rows so far (a tensor per value, grown as generated tokens come). A request whose capture names
    a destination the worker could open (`shared_rows`) keeps its rows there: ``region`` (``[values, rows, hidden]``),
    its own rows from row ``first`` on, ``capacity`` of them (``tensors`` is then empty)."""

    wire: dict[str, Any]
    slots: list[int]
    tensors: list[torch.Tensor]
    filled: int = 0
    taken: bool = False
    region: Region | None = None
    first: int = 0
    capacity: int = 0
    #: Held while the tensors grow and while rows are written into them: on an accelerator the writer thread
    #: writes a step's rows while the engine's thread makes room for the next step's.
    growing: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def room(self, rows: int) -> None:
        """Make each tensor hold at least ``rows`` rows (doubling), keeping what it holds; a region's rows cannot
        grow."""
        if self.region is not None:
            if rows > self.capacity:
                raise RuntimeError(f"a request kept {rows} rows into a region that holds {self.capacity} for it")
            return
        capacity = self.tensors[0].shape[0]
        if rows <= capacity:
            return
        capacity = max(rows, 2 * capacity)
        with self.growing:
            grown = []
            for tensor in self.tensors:
                bigger = tensor.new_empty((capacity, *tensor.shape[1:]))
                bigger[: self.filled] = tensor[: self.filled]
                grown.append(bigger)
            self.tensors = grown

    def named(self) -> dict[str, torch.Tensor] | None:
        """Each value's rows so far, ``[kept, hidden]``, in position order; ``None`` where they lie in the region."""
        if self.region is not None:
            return None
        return {name: tensor[: self.filled] for name, tensor in zip(self.wire["values"], self.tensors)}

    def handed_back(self, saes: dict[int, DeviceSAE], buffer: torch.Tensor | None) -> dict[str, torch.Tensor] | None:
        """What the client gets (`named`): where the capture asks for SAE features, each of them encoded by the SAE
        at its block (``saes``, on the engine's device, into its encoding ``buffer``) from the block's kept rows
        (`encoded_features`), and only the values the capture asked for."""
        named = self.named()
        if named is None or "sae" not in self.wire:
            return named
        for entry in self.wire["sae"]:
            named.update(encoded_features(saes[entry["layer"]], named[entry["source"]], entry, buffer))
        return {name: named[name] for name in self.wire["returned"]}


def encoded_features(
    sae: DeviceSAE, rows: torch.Tensor, entry: dict[str, Any], buffer: torch.Tensor
) -> dict[str, torch.Tensor]:
    """An SAE-feature capture (an entry of a wire's ``"sae"``) of ``rows`` ``[kept, hidden]``, encoded a bounded part
    at a time into ``buffer``: the top-k's ``<name>.indices`` (int64) and ``<name>.values``, or the chosen
    features' ``<name>``, ``[kept, k]`` float32 on the CPU."""
    chosen = entry["features"]
    width = len(chosen) if chosen is not None else entry["top_k"]
    values = torch.empty(len(rows), width, dtype=torch.float32)
    indices = torch.empty(len(rows), width, dtype=torch.int64) if chosen is None else None
    for start, features in sae.encoded(rows, buffer):
        end = start + len(features)
        if chosen is not None:
            values[start:end] = features[:, chosen].cpu()
        else:
            top = features.topk(width, dim=-1)
            values[start:end], indices[start:end] = top.values.cpu(), top.indices.cpu()
    if chosen is not None:
        return {entry["name"]: values}
    return {f"{entry['name']}.indices": indices, f"{entry['name']}.values": values}


def keeps_rows() -> bool:
    """Whether this worker keeps captured rows: only the first tensor-parallel rank does, the streams being whole
    on every rank (call inside a worker, where vLLM's parallel groups exist)."""
    from vllm.distributed import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() == 0


@dataclasses.dataclass
class Piece:
    """A run of one kept value's rows of a step: ``length`` rows of the capture buffer's ``slot`` from token
    ``token`` of the step, going to rows ``row`` on of ``value`` of the request's ``kept`` rows (or, for requests
    lying next to each other in one region, merged, of ``region``)."""

    kept: KeptRows | None
    region: Region | None
    value: int
    slot: int
    token: int
    row: int
    length: int

    def write(self, rows: torch.Tensor) -> None:
        """Write the piece's ``rows`` (``[length, hidden]``, on the host) where they go."""
        if self.region is not None:
            self.region.put(self.row, rows[None], self.value)
        else:
            with self.kept.growing:
                self.kept.tensors[self.value][self.row : self.row + len(rows)].copy_(rows)

    def part(self, skip: int, length: int) -> Piece:
        """The piece's rows ``skip`` to ``skip + length``."""
        return dataclasses.replace(self, token=self.token + skip, row=self.row + skip, length=length)


def pieces(step: Sequence[tuple[KeptRows, int, int, int]]) -> list[Piece]:
    """One step's runs (each ``(request, first token in the step, first row of the request, length)``) as pieces,
    one per value per run; runs of requests whose rows lie next to each other in one region, as they lie in the
    step, merged into one piece per value. Each request's tensors are first made to hold the rows it gets."""
    merged: list[list[Any]] = []  # [region, slots, first token, first region row, length]
    made: list[Piece] = []
    for kept, token, row, length in step:
        kept.room(row + length)
        kept.filled = max(kept.filled, row + length)
        if kept.region is None:
            made += [Piece(kept, None, value, slot, token, row, length) for value, slot in enumerate(kept.slots)]
            continue
        last = merged[-1] if merged else None
        if (
            last is not None
            and last[0] is kept.region
            and last[1] == kept.slots
            and last[2] + last[4] == token
            and last[3] + last[4] == kept.first + row
        ):
            last[4] += length
        else:
            merged.append([kept.region, kept.slots, token, kept.first + row, length])
    for region, slots, token, row, length in merged:
        made += [Piece(None, region, value, slot, token, row, length) for value, slot in enumerate(slots)]
    return made


def hand_on(rows: torch.Tensor, step: Sequence[tuple[KeptRows, int, int, int]]) -> None:
    """Copy one step's kept rows, ``rows [values, step tokens, hidden]`` on the host, into their requests' tensors
    or regions (`pieces`)."""
    for piece in pieces(step):
        piece.write(rows[piece.slot, piece.token : piece.token + piece.length])


class RowsLeaving:
    """Kept rows leaving an accelerator without a host sync in the step: only the rows some request keeps, written
    by a thread of their own.

    After a step's forward, the rows its requests keep are gathered on the compute stream, by an index of the
    capture buffer's rows written in pinned host memory before (the memory model's ``capture row index``), into the
    compact buffer (``capture compact rows``), so the next step's forward may write the capture buffer again. The
    writer thread then copies the compact rows to the `HOST_BUFFERS` pinned host buffers (``capture rows on the
    host``), a buffer's worth at a time, on a copy stream of its own that waits for the gather, and hands each part
    on once its copy has completed (into the requests' tensors or their regions, whose writes release the GIL), in
    step order, overlapped with the engine's next steps. A host buffer is reused only once its rows are written,
    so the host buffers bound the memory held; the next step's gather waits (on the device) for the last copy out
    of the compact buffer, so the engine's thread waits only for the writer to have sent every part of the step
    before, which it has unless the disk is the slower. What the writer fails with is raised on the engine's thread
    at the next `send` or `deliver`, and nothing more is written.

    ``device`` is the accelerator's torch module (``torch.cuda``: its ``Stream``, ``Event``, ``current_stream``,
    ``stream``).
    """

    def __init__(self, rows: torch.Tensor, ledger: Ledger, device: Any) -> None:
        self.rows, self.device = rows, device
        self.compact = ledger.allocate("capture compact rows", fill=None)
        self.index = ledger.allocate("capture row index")
        self.host_index = ledger.allocate("capture row index written")
        self.hosts = ledger.allocate("capture rows on the host", fill=None)
        self.stream = device.Stream(rows.device)
        #: The event the next gather waits for (the last copy out of the compact buffer), once the writer sent it.
        self.compact_free: Any = None
        self.index_free: Any = None
        self.sent = 0
        self.failure: Exception | None = None
        self.written = threading.Condition()
        #: Steps sent and not yet written.
        self.pending = 0
        self.handed: queue.Queue[tuple[Any, list[Piece], int] | None] = queue.Queue()
        self.writer = threading.Thread(target=self._write, name="nnterp-vllm-kept-rows", daemon=True)
        self.writer.start()

    @property
    def moved(self) -> int:
        """Rows copied off the device so far."""
        return self.sent

    def send(self, step: list[tuple[KeptRows, int, int, int]], tokens: int) -> None:
        """Gather the step's kept rows into the compact buffer (enqueued on the compute stream, after the previous
        step's rows have left it) and hand them to the writer."""
        self._raise_failure()
        made = pieces(step)
        count = sum(piece.length for piece in made)
        if not count:
            return
        values, capacity, _ = self.rows.shape
        if self.index_free is not None:
            self.index_free.synchronize()  # the previous step's index has reached the device (long since, as a rule)
        index = self.host_index.numpy()
        at = 0
        for piece in made:
            start = piece.slot * capacity + piece.token
            index[at : at + piece.length] = np.arange(start, start + piece.length)
            at += piece.length
        compute = self.device.current_stream(self.rows.device)
        self.index[:count].copy_(self.host_index[:count], non_blocking=True)
        self.index_free = self.device.Event()
        self.index_free.record(compute)
        with self.written:  # the writer has sent every part of the step before out of the compact buffer
            self.written.wait_for(lambda: self.compact_free is not None or self.failure is not None)
        self._raise_failure()
        free, self.compact_free = self.compact_free, None
        if free is not True:
            compute.wait_event(free)
        torch.index_select(self.rows.view(values * capacity, -1), 0, self.index[:count], out=self.compact[:count])
        gathered = self.device.Event()
        gathered.record(compute)
        with self.written:
            self.pending += 1
        self.handed.put((gathered, made, count))

    def deliver(self, wait: bool) -> None:
        """Raise what the writer failed with; where ``wait``, return once it has written every step sent."""
        self._raise_failure()
        if wait:
            with self.written:
                self.written.wait_for(lambda: not self.pending or self.failure is not None)
            self._raise_failure()

    def close(self) -> None:
        """Write every step sent, then stop the writer thread (raising what it failed with, if anything)."""
        try:
            self.deliver(wait=True)
        finally:
            self.handed.put(None)
            self.writer.join()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _write(self) -> None:
        """The writer thread: copy each step's compact rows to the host buffers part by part, handing each part on
        once it has arrived, in order; stop at `close` or at the first failure, kept for the engine's thread."""
        with self.written:
            self.compact_free = True  # the first gather waits for nothing
            self.written.notify_all()
        on_the_way: collections.deque[tuple[Any, torch.Tensor, int, list[Piece], int]] = collections.deque()
        turn = 0
        with torch.inference_mode():  # the requests' tensors were made in vLLM's inference mode
            while (handed := self.handed.get()) is not None:
                gathered, made, count = handed
                try:
                    self.stream.wait_event(gathered)
                    part = self.hosts.shape[1]
                    for start in range(0, count, part):
                        if len(on_the_way) == len(self.hosts):
                            self._hand_on(*on_the_way.popleft())
                        host = self.hosts[turn % len(self.hosts)]
                        turn += 1
                        length = min(part, count - start)
                        with self.device.stream(self.stream):
                            host[:length].copy_(self.compact[start : start + length], non_blocking=True)
                            arrived = self.device.Event()
                            arrived.record(self.stream)
                        on_the_way.append((arrived, host, start, made, length))
                    with self.written:
                        self.compact_free = arrived
                        self.written.notify_all()
                    while on_the_way:
                        self._hand_on(*on_the_way.popleft())
                    self.sent += count
                except Exception as failure:
                    with self.written:
                        self.failure = failure
                        self.written.notify_all()
                    return
                with self.written:
                    self.pending -= 1
                    self.written.notify_all()

    @staticmethod
    def _hand_on(arrived: Any, host: torch.Tensor, start: int, made: list[Piece], length: int) -> None:
        """Once a part's copy has arrived, write its rows (the step's compact rows ``start`` to ``start + length``,
        in the host buffer ``host``) where their pieces go."""
        arrived.synchronize()
        at = 0
        for piece in made:
            low, high = max(at, start), min(at + piece.length, start + length)
            if low < high:
                piece.part(low - at, high - low).write(host[low - start : high - start])
            at += piece.length


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
        found = locate(model, Standardized._model_type(model_config.hf_config), self.names)
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


__all__ = [
    "Capturer",
    "KeptRows",
    "RowsLeaving",
    "hand_on",
    "keep_rows",
    "keeps_rows",
    "locate",
    "pack",
    "standard_tree",
    "unpack",
]
