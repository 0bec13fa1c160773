"""Kept rows written straight into memory the client shares with the engine: a harvest's shard, filled in place.

A capture may name a destination (`SharedRows.destination`, under ``INTO`` in its engine form): a region of
memory the client made, ``[values, rows, hidden]`` in the capture's dtype, and the first row of it that is the
request's. The worker opens the region (`open_region`) and writes the request's rows into it, so they are
copied once, from the engine's buffer, and never cross the engine's RPC; a step's rows for requests that lie
next to each other in the region go in one copy per step (`capture.hand_on`). The region is an anonymous
memory file (``memfd_create``) that the worker opens by its ``/proc`` path, so it is freed once the client
and the worker have both let go of it, however either ends: nothing is left behind in ``/dev/shm``; or a span
of a file the client made (a harvest's shard, its values filled where the file holds them), which the worker
opens by its path. A worker on another host, or one that cannot open the file, keeps the rows in tensors of its
own as usual; the client copies those in (`SharedRows.fill`).
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Any

import torch

#: The key of a capture's engine form that names its destination.
INTO = "into"


class SharedRows:
    """A ``[values, rows, hidden]`` region of shared memory in ``dtype``, which an engine on this host fills in place:
    a memory file of its own, or the bytes of ``file`` from ``start`` on (a file as long as that already, ``start``
    a multiple of ``dtype``'s size).

    ``tensor`` is the region; `close` lets go of it (the worker lets go of its own hold when the requests
    writing into it are taken).
    """

    def __init__(
        self, values: int, rows: int, hidden: int, dtype: torch.dtype, file: Path | None = None, start: int = 0
    ) -> None:
        self.shape = (values, rows, hidden)
        count = values * rows * hidden
        self.id = uuid.uuid4().hex
        self.descriptor: int | None = None
        if file is None:
            self.descriptor = os.memfd_create("nnterp-vllm-rows", os.MFD_CLOEXEC)
            os.ftruncate(self.descriptor, max(1, count * dtype.itemsize))
            self.path = f"/proc/{os.getpid()}/fd/{self.descriptor}"
        else:
            self.path = str(Path(file).resolve())
        self.offset = start // dtype.itemsize
        mapping = torch.from_file(self.path, shared=True, size=self.offset + max(1, count), dtype=dtype)
        self.tensor = mapping[self.offset : self.offset + count].view(self.shape)

    def destination(self, first: int) -> dict[str, Any]:
        """A capture's ``INTO`` entry: the request's rows go to this region from row ``first`` on."""
        return {
            "id": self.id,
            "path": self.path,
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

    def close(self) -> None:
        """Let go of the region (its memory is freed once the worker has too)."""
        if self.descriptor is not None:
            os.close(self.descriptor)
            self.descriptor = None


class Region:
    """A destination as the worker holds it: its ``rows`` per value, and `put`, which writes rows into it through the
    file (the kernel copies them into its pages, where filling a fresh mapping would fault each page in first).
    `close` lets go of it."""

    def __init__(self, into: dict[str, Any], dtype: torch.dtype) -> None:
        _, self.rows, hidden = into["shape"]
        self.dtype = dtype
        self.row_bytes = hidden * dtype.itemsize
        self.value_bytes = self.rows * self.row_bytes
        self.start = into["offset"] * dtype.itemsize
        self.descriptor = os.open(into["path"], os.O_WRONLY | os.O_CLOEXEC)

    def put(self, row: int, rows: torch.Tensor) -> None:
        """Write ``rows`` (``[values, length, hidden]``, on the host) to rows ``row`` on of each value, in the
        region's dtype."""
        for index, values in enumerate(rows):
            data = values.to(self.dtype).contiguous()  # the rows themselves where they already are
            buffer = memoryview(data.view(torch.uint8).numpy()).cast("B")
            position = self.start + index * self.value_bytes + row * self.row_bytes
            while len(buffer):
                written = os.pwrite(self.descriptor, buffer, position)
                buffer, position = buffer[written:], position + written

    def close(self) -> None:
        os.close(self.descriptor)


def open_region(into: dict[str, Any], dtype: torch.dtype) -> Region | None:
    """The region ``into`` names, opened in this process; ``None`` where it lies on another host or cannot be opened
    (the rows are then kept as usual)."""
    if into["host"] != socket.gethostname():
        return None
    try:
        return Region(into, dtype)
    except OSError:
        return None


__all__ = ["INTO", "Region", "SharedRows", "open_region"]
