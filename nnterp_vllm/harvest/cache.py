"""A harvest on a store, read at training speed: byte ranges of the shards, through a local read-through cache.

A shard is read in blocks of `BLOCK` bytes, each fetched once (many at a time, concurrently, by the file system's
own range reads) into a file of the cache directory, named by the shard's checksum and the block's number (a shard
computed again has another checksum, so nothing stale is ever served). Reads then go from those files straight into
their places, as a local shard's do (``preadv``). The directory is bounded in bytes: past ``max_bytes`` the blocks
read longest ago are removed (a read's own blocks are kept until it is done). Several processes may share one
directory: a block another process removed is fetched again.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ..checksums import recorded_checksum
from .files import staging
from .layouts import Source
from .location import Location

#: Bytes of a cached block of a shard.
BLOCK = 8 * 2**20
#: The cache's bound in bytes unless the caller gives one.
CACHE_BYTES = 8 * 2**30


def default_directory() -> Path:
    """Where blocks are cached unless the caller says: ``$XDG_CACHE_HOME/nnterp_vllm/harvest-blocks``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "nnterp_vllm" / "harvest-blocks"


class BlockCache:
    """The read-through cache of one reader: blocks of shards on a store, as files in ``directory``, at most
    ``max_bytes`` of them (the least recently read removed first)."""

    def __init__(self, directory: Path | str | None = None, max_bytes: int = CACHE_BYTES) -> None:
        self.directory = Path(directory) if directory is not None else default_directory()
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        #: Each cached block's file name -> its size, least recently read first (what the directory held is
        #: read at the first read: opening a harvest creates nothing).
        self.blocks: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.opened = False
        #: Bytes fetched from the store so far.
        self.fetched = 0

    def _open_directory(self) -> None:
        """Take in what the directory holds (made if missing), oldest first, within the bound (under the lock)."""
        if self.opened:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        found = [path for path in self.directory.iterdir() if path.suffix == ".block"]
        for path in sorted(found, key=lambda path: path.stat().st_mtime):
            self.blocks[path.name] = path.stat().st_size
        self.opened = True
        self._evict(set())

    def source(self, location: Location, record: dict[str, Any]) -> CachedSource:
        """A reader of the shard ``record`` names on ``location``, through this cache."""
        return CachedSource(self, location, record)

    @property
    def size(self) -> int:
        """The bytes cached now."""
        return sum(self.blocks.values())

    def ensure(self, location: Location, record: dict[str, Any], numbers: list[int]) -> None:
        """Have blocks ``numbers`` of the shard cached, fetching the missing ones in one concurrent call."""
        prefix = _prefix(record)
        with self.lock:
            self._open_directory()
            missing = [n for n in numbers if f"{prefix}-{n}.block" not in self.blocks]
            for n in numbers:
                if f"{prefix}-{n}.block" in self.blocks:
                    self.blocks.move_to_end(f"{prefix}-{n}.block")
        if not missing:
            return
        path = location.path(record["file"])
        starts = [n * BLOCK for n in missing]
        stops = [min((n + 1) * BLOCK, record["bytes"]) for n in missing]
        datas = location.fs.cat_ranges([path] * len(missing), starts, stops)
        for number, data in zip(missing, datas):
            if isinstance(data, BaseException):
                raise data
            target = self.directory / f"{prefix}-{number}.block"
            temporary = staging(target)
            temporary.write_bytes(data)
            os.replace(temporary, target)
            with self.lock:
                self.blocks[target.name] = len(data)
                self.fetched += len(data)
        with self.lock:
            self._evict({f"{prefix}-{n}.block" for n in numbers})

    def _evict(self, keep: set[str]) -> None:
        total = sum(self.blocks.values())
        for name in list(self.blocks):
            if total <= self.max_bytes:
                return
            if name not in keep:
                total -= self.blocks.pop(name)
                (self.directory / name).unlink(missing_ok=True)

    def open(self, location: Location, record: dict[str, Any], number: int) -> int:
        """A descriptor of block ``number`` of the shard (fetched again if another reader removed it)."""
        target = self.directory / f"{_prefix(record)}-{number}.block"
        for _ in range(3):
            try:
                return os.open(target, os.O_RDONLY)
            except FileNotFoundError:
                with self.lock:
                    self.blocks.pop(target.name, None)
                self.ensure(location, record, [number])
        return os.open(target, os.O_RDONLY)


def _prefix(record: dict[str, Any]) -> str:
    return f"{record[recorded_checksum(record)]}"


class CachedSource(Source):
    """A shard on a store, read as a local one (`layouts.Source`), from the blocks its cache holds."""

    def __init__(self, cache: BlockCache, location: Location, record: dict[str, Any]) -> None:
        self.cache, self.location, self.record = cache, location, record
        self.descriptors: dict[int, int] = {}

    def prefetch(self, spans: list[tuple[int, int]]) -> None:
        """Fetch at once every block the byte spans ``(offset, length)`` touch."""
        numbers = sorted({n for offset, length in spans if length for n in _blocks(offset, length)})
        if numbers:
            self.cache.ensure(self.location, self.record, numbers)

    def _descriptor(self, number: int) -> int:
        if number not in self.descriptors:
            self.descriptors[number] = self.cache.open(self.location, self.record, number)
        return self.descriptors[number]

    def read(self, offset: int, size: int) -> bytes:
        size = max(0, min(size, self.record["bytes"] - offset))
        buffer = bytearray(size)
        if size:
            address = np.frombuffer(buffer, np.uint8).ctypes.data
            self.read_vectors(np.array([[address, size]], np.uint64), offset)
        return bytes(buffer)

    def read_vectors(self, vectors: np.ndarray, offset: int) -> None:
        lengths = vectors[:, 1].astype(np.int64)
        total = int(lengths.sum())
        if offset + total > self.record["bytes"]:
            raise ValueError(
                f"the file ends {offset + total - self.record['bytes']} bytes short of the rows the manifest records"
            )
        if not total:
            return
        numbers = list(_blocks(offset, total))
        self.prefetch([(offset, total)])
        starts = offset + np.concatenate([[0], np.cumsum(lengths)[:-1]])  # each buffer's first byte in the file
        stops = starts + lengths
        for number in numbers:
            low, high = number * BLOCK, (number + 1) * BLOCK
            first = int(np.searchsorted(stops, low, side="right"))
            last = int(np.searchsorted(starts, high, side="left"))
            begin = np.maximum(starts[first:last], low)
            end = np.minimum(stops[first:last], high)
            pieces = np.empty((last - first, 2), np.uint64)
            pieces[:, 0] = vectors[first:last, 0] + (begin - starts[first:last]).astype(np.uint64)
            pieces[:, 1] = (end - begin).astype(np.uint64)
            Source(self._descriptor(number)).read_vectors(pieces, int(begin[0]) - low)

    def close(self) -> None:
        for descriptor in self.descriptors.values():
            with contextlib.suppress(OSError):
                os.close(descriptor)
        self.descriptors.clear()


def _blocks(offset: int, length: int) -> range:
    return range(offset // BLOCK, (offset + length - 1) // BLOCK + 1)


__all__ = ["BLOCK", "CACHE_BYTES", "BlockCache", "CachedSource", "default_directory"]
