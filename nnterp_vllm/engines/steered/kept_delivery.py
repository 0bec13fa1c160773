"""Where a step's kept rows go: each capturing request's own rows (`KeptRows`: tensors of its own, or its part of a
shared-memory region, `shared_rows`), which a step's rows reach one piece per value per run of the request's tokens
(`Piece`), by position. On the CPU they are handed on at once, from the capture buffer (`hand_on`); from an
accelerator only the rows some request keeps leave the device, without a host sync (`RowsLeaving`).
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .memory import Ledger
from .sae_encoding import DeviceSAE
from .shared_rows import Region


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


__all__ = ["KeptRows", "Piece", "RowsLeaving", "encoded_features", "hand_on", "pieces"]
