"""Kept rows written straight into memory the client shares with the engine: a harvest's shard, filled in place.

A capture may name a destination (`SharedRows.destination`, under ``INTO`` in its engine form): a region of
memory the client made, ``[values, rows, hidden]`` in the capture's dtype, and the first row of it that is the
request's. The worker opens the region (`open_region`) and writes the request's rows into it, so they are
copied once, from the engine's buffer, and never cross the engine's RPC; a step's rows for requests that lie
next to each other in the region go in one copy per step (`kept_delivery.hand_on`). The region is an anonymous
memory file (``memfd_create``) that the worker opens by its ``/proc`` path, so it is freed once the client
and the worker have both let go of it, however either ends: nothing is left behind in ``/dev/shm``; or a span
of a file the client made (a harvest's shard, its values filled where the file holds them), which the worker
opens by its path and writes a chunk at a time (`Region`), leaving each chunk's digest in a table the client
reads (`SharedRows.chunk_digests`). A worker on another host, or one that cannot open the file, keeps the rows
in tensors of its own as usual; the client copies those in (`SharedRows.fill`).
"""

from __future__ import annotations

import bisect
import errno
import mmap
import os
import queue
import socket
import threading
import uuid
from pathlib import Path
from typing import Any

import torch

from ...checksums import CHUNK, chunk_digest

#: The key of a capture's engine form that names its destination.
INTO = "into"
#: Bytes of an entry of a file region's digest table: a flag (the chunk was hashed as written), then its digest.
DIGEST_ENTRY = 17
#: Whole chunks a file region holds complete, waiting for the disk, at most: the engine's thread waits for the disk
#: only when it is this far ahead of it.
QUEUED_CHUNKS = 256
#: Threads writing a file region's whole chunks: the disk sees as many writes at once.
CHUNK_WRITERS = 4
#: Chunks a writer takes at a time, at most: consecutive ones go to the disk in one write.
CHUNK_RUN = 8
#: Chunk buffers a worker keeps for the next chunks once written, at most, while a region is open (reused memory is
#: fast to fill, where memory the process has not touched before must first be faulted in); none once none is.
POOLED_CHUNKS = 512


class SharedRows:
    """A ``[values, rows, hidden]`` region of shared memory in ``dtype``, which an engine on this host fills in place:
    a memory file of its own, or the bytes of ``file`` from ``start`` on (a file as long as that already, ``start``
    a multiple of ``dtype``'s size).

    ``tensor`` is the region; `chunk_digests` what the worker hashed of a file as it wrote it; `close` lets go of
    the region (the worker lets go of its own hold when the requests writing into it are taken).
    """

    def __init__(
        self, values: int, rows: int, hidden: int, dtype: torch.dtype, file: Path | None = None, start: int = 0
    ) -> None:
        self.shape = (values, rows, hidden)
        count = values * rows * hidden
        self.id = uuid.uuid4().hex
        self.descriptor: int | None = None
        self.table: int | None = None
        if file is None:
            self.descriptor = _memory_file(count * dtype.itemsize)
            self.path = f"/proc/{os.getpid()}/fd/{self.descriptor}"
        else:
            self.path = os.path.abspath(file)  # not resolved: a memory file is reached by its /proc link
            self.table = _memory_file(-(-(start + count * dtype.itemsize) // CHUNK) * DIGEST_ENTRY)
        self.offset = start // dtype.itemsize
        mapping = torch.from_file(self.path, shared=True, size=self.offset + max(1, count), dtype=dtype)
        self.tensor = mapping[self.offset : self.offset + count].view(self.shape)

    def destination(self, first: int) -> dict[str, Any]:
        """A capture's ``INTO`` entry: the request's rows go to this region from row ``first`` on."""
        return {
            "id": self.id,
            "path": self.path,
            "digests": None if self.table is None else f"/proc/{os.getpid()}/fd/{self.table}",
            "host": socket.gethostname(),
            "shape": list(self.shape),
            "offset": self.offset,
            "first": first,
        }

    def fill(self, first: int, rows: dict[str, torch.Tensor], names: list[str]) -> None:
        """Copy rows a worker kept in tensors of its own (``rows``: value name -> ``[kept, hidden]``) to their place."""
        for index, name in enumerate(names):
            kept = rows[name]
            self.tensor[index, first : first + len(kept)].copy_(kept)

    def chunk_digests(self) -> dict[int, bytes]:
        """The digests of the file's chunks (`checksums.chunk_digest`, by chunk) the worker computed as it wrote them
        (complete once the requests writing here are taken); none for a memory file."""
        if self.table is None:
            return {}
        table = os.pread(self.table, os.fstat(self.table).st_size, 0)
        entries = (table[at : at + DIGEST_ENTRY] for at in range(0, len(table), DIGEST_ENTRY))
        return {chunk: entry[1:] for chunk, entry in enumerate(entries) if entry[0]}

    def close(self) -> None:
        """Let go of the region (its memory is freed once the worker has too)."""
        for descriptor in (self.descriptor, self.table):
            if descriptor is not None:
                os.close(descriptor)
        self.descriptor = self.table = None


def _memory_file(size: int) -> int:
    """A descriptor of a new anonymous memory file of ``size`` bytes (at least one)."""
    descriptor = os.memfd_create("nnterp-vllm-rows", os.MFD_CLOEXEC)
    os.ftruncate(descriptor, max(1, size))
    return descriptor


class Region:
    """A destination as the worker holds it: `put` writes rows into it, `close` lets go of it once they are written.

    A file's whole `checksums.CHUNK` s are gathered in memory reused from chunk to chunk and each is written once
    complete, by `CHUNK_WRITERS` threads of the region's own, straight to the disk (``O_DIRECT``) where the file
    system allows it: the engine's thread only copies rows in memory, and no page the kernel must first allocate is
    filled (which on some machines costs more than the copy). Each such chunk's digest is computed from memory as it
    is written and left in the client's table once it is in the file, so the shard's checksum reads nothing back and
    the client knows which chunks are final (a shard streamed to a store sends a part once all its chunks are). The
    rest goes through the page cache, as any file's writes: the region's partial first and last chunks, a memory
    file of the region's own, a chunk written to again after it went to the file (its digest then withdrawn). At most
    `QUEUED_CHUNKS` complete chunks wait for the disk (a disk slower than the engine holds it back only then), and
    `close` waits for none: those still waiting then are written through the page cache, as the writers finish theirs.
    """

    def __init__(self, into: dict[str, Any], dtype: torch.dtype) -> None:
        values, self.rows, hidden = into["shape"]
        self.dtype = dtype
        self.row_bytes = hidden * dtype.itemsize
        self.value_bytes = self.rows * self.row_bytes
        self.start = into["offset"] * dtype.itemsize
        self.descriptor = os.open(into["path"], os.O_WRONLY | os.O_CLOEXEC)
        self.direct: int | None = None
        self.table: int | None = None
        try:
            if into.get("digests"):
                self.table = os.open(into["digests"], os.O_WRONLY | os.O_CLOEXEC)
                self.direct = os.open(into["path"], os.O_WRONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError:  # no O_DIRECT here: whole chunks are written through the page cache too
            pass
        end = self.start + values * self.value_bytes
        #: The chunks written whole: from byte ``low`` to byte ``high`` (none where no digest table is given).
        self.low = -(-self.start // CHUNK) * CHUNK if self.table is not None else 0
        self.high = max(self.low, end // CHUNK * CHUNK) if self.table is not None else 0
        #: Chunks being gathered: chunk -> its buffer and the spans of it filled so far (sorted, disjoint).
        self.gathering: dict[int, tuple[mmap.mmap, list[list[int]]]] = {}
        self.sent: set[int] = set()
        self.queue: queue.Queue[tuple[int, mmap.mmap] | None] = queue.Queue(QUEUED_CHUNKS)
        self.writers: list[threading.Thread] = []
        self.failure: Exception | None = None
        _OPEN.add(self)

    def put(self, row: int, rows: torch.Tensor, value: int = 0) -> None:
        """Write ``rows`` (``[values, length, hidden]``, on the host) to rows ``row`` on of each value, from the
        region's value ``value`` on, in the region's dtype."""
        self._raise_failure()
        for index, values in enumerate(rows, start=value):
            data = values.to(self.dtype).contiguous()  # the rows themselves where they already are
            buffer = memoryview(data.view(torch.uint8).numpy()).cast("B")
            self._place(self.start + index * self.value_bytes + row * self.row_bytes, buffer)

    def _place(self, position: int, buffer: memoryview) -> None:
        """Write ``buffer`` at byte ``position`` of the file: its whole chunks gathered, the rest through the page
        cache."""
        end = position + len(buffer)
        low, high = min(max(position, self.low), end), max(min(end, self.high), position)
        if low >= high:
            low = high = end
        _write(self.descriptor, buffer[: low - position], position)
        _write(self.descriptor, buffer[high - position :], high)
        while low < high:
            chunk = low // CHUNK
            top = min(high, (chunk + 1) * CHUNK)
            part = buffer[low - position : top - position]
            if chunk in self.sent:  # on the disk already, its digest given: through the page cache, withdrawn
                self._settle()
                os.pwrite(self.table, b"\0", chunk * DIGEST_ENTRY)
                _write(self.descriptor, part, low)
            else:
                self._gather(chunk, low - chunk * CHUNK, part)
            low = top

    def _gather(self, chunk: int, at: int, part: memoryview) -> None:
        """Copy ``part`` to byte ``at`` of ``chunk``'s buffer; send the chunk to the disk once it is whole."""
        if chunk not in self.gathering:
            self.gathering[chunk] = (_POOL.pop() if _POOL else _new_chunk(), [])
        buffer, spans = self.gathering[chunk]
        buffer[at : at + len(part)] = part
        _add_span(spans, at, at + len(part))
        if spans == [[0, CHUNK]]:
            del self.gathering[chunk]
            self.sent.add(chunk)
            if not self.writers:
                self.writers = [
                    threading.Thread(target=self._write_chunks, name="nnterp-vllm-chunks", daemon=True)
                    for _ in range(CHUNK_WRITERS)
                ]
                for writer in self.writers:
                    writer.start()
            self.queue.put((chunk, buffer))

    def _write_chunks(self) -> None:
        """A writer thread of the region: takes the chunks waiting, up to `CHUNK_RUN` at a time, and writes them
        (`_take`) until it takes an end (``None``, one per writer, queued after every chunk)."""
        while True:
            taken = [self.queue.get()]
            while len(taken) < CHUNK_RUN and taken[-1] is not None:
                try:
                    taken.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            end = taken[-1] is None
            self._take(taken[:-1] if end else taken, direct=True)
            if end:
                self.queue.task_done()
                return

    def _take(self, taken: list[tuple[int, mmap.mmap]], direct: bool) -> None:
        """Hash and write chunks taken from the queue, each run of consecutive ones in one call (straight to the disk
        where ``direct``), their digests left in the table; what fails is kept for the engine's thread, which raises
        it."""
        taken = sorted(taken, key=lambda sent: sent[0])
        try:
            if self.failure is None:
                digests = [chunk_digest(buffer) for _, buffer in taken]
                first = 0
                for last in range(1, len(taken) + 1):
                    if last == len(taken) or taken[last][0] != taken[last - 1][0] + 1:
                        self._write_run(taken[first][0], [buffer for _, buffer in taken[first:last]], direct)
                        first = last
                for (chunk, _), digest in zip(taken, digests):
                    os.pwrite(self.table, b"\1" + digest, chunk * DIGEST_ENTRY)
        except Exception as failure:
            self.failure = failure
        finally:
            for _, buffer in taken:
                self._release(buffer)
                self.queue.task_done()

    def _write_run(self, chunk: int, buffers: list[mmap.mmap], direct: bool) -> None:
        """Write ``buffers`` back to back from chunk ``chunk`` on."""
        direct = direct and self.direct is not None
        try:
            written = os.pwritev(self.direct if direct else self.descriptor, buffers, chunk * CHUNK)
        except OSError as refused:
            if not direct or refused.errno != errno.EINVAL:
                raise
            written = 0  # O_DIRECT refused for this file after all: all of it through the page cache, below
        for at, buffer in enumerate(buffers):  # what a short write left, through the page cache
            done = min(max(written - at * CHUNK, 0), CHUNK)
            if done < CHUNK:
                _write(self.descriptor, memoryview(buffer)[done:], (chunk + at) * CHUNK + done)

    def _settle(self) -> None:
        """Wait until every chunk sent is written; raise what writing one failed with."""
        if self.writers:
            self.queue.join()
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        """Write what is still gathered (the spans filled of chunks never made whole) and the chunks still waiting for
        the disk, both through the page cache, wait for the writers' last chunks, and let go of the file; raise what
        writing failed with."""
        try:
            for chunk, (buffer, spans) in self.gathering.items():
                for low, high in spans:
                    _write(self.descriptor, memoryview(buffer)[low:high], chunk * CHUNK + low)
                self._release(buffer)
            self.gathering.clear()
            while self.writers:
                try:
                    chunk, buffer = self.queue.get_nowait()
                except queue.Empty:
                    break
                self._take([(chunk, buffer)], direct=False)
            self._settle()
        finally:
            for _ in self.writers:
                self.queue.put(None)
            for writer in self.writers:
                writer.join()
            for descriptor in (self.descriptor, self.direct, self.table):
                if descriptor is not None:
                    os.close(descriptor)
            _OPEN.discard(self)
            if not _OPEN:
                _POOL.clear()  # each buffer unmapped once nothing holds it

    @staticmethod
    def _release(buffer: mmap.mmap) -> None:
        if len(_POOL) < POOLED_CHUNKS:
            _POOL.append(buffer)


#: Chunk buffers written and free for the next chunk, in this process.
_POOL: list[mmap.mmap] = []
#: The regions open in this process.
_OPEN: set[Region] = set()


def _new_chunk() -> mmap.mmap:
    """A chunk buffer, its pages faulted in as it is made (in one call, where touching each would fault it)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, CHUNK, flags=flags)


def _write(descriptor: int, buffer: memoryview, position: int) -> None:
    """Write all of ``buffer`` at byte ``position``."""
    while len(buffer):
        written = os.pwrite(descriptor, buffer, position)
        buffer, position = buffer[written:], position + written


def _add_span(spans: list[list[int]], low: int, high: int) -> None:
    """Add ``[low, high)`` to ``spans`` (sorted, disjoint, touching ones merged)."""
    at = bisect.bisect_left(spans, [low])
    if at and spans[at - 1][1] >= low:
        at -= 1
        low = spans[at][0]
    last = at
    while last < len(spans) and spans[last][0] <= high:
        high = max(high, spans[last][1])
        last += 1
    spans[at:last] = [[low, high]]


def open_region(into: dict[str, Any], dtype: torch.dtype) -> Region | str:
    """The region ``into`` names, opened in this process; else why not (it lies on another host, or cannot be
    opened): the rows are then kept as usual, for the client to copy in."""
    if into["host"] != socket.gethostname():
        return f"it lies on {into['host']}, not on this worker's host {socket.gethostname()}"
    try:
        return Region(into, dtype)
    except OSError as error:
        return f"cannot open {into['path']}: {error.strerror or error}"


__all__ = ["INTO", "Region", "SharedRows", "open_region"]
