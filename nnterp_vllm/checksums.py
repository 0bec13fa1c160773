"""Shard checksums: xxh3-128 for the shards this version writes, sha256 still checked for older harvests'.

A checksum is computed once, over the bytes as a layout writes them, and recomputed from
the file only to check a shard (a resume, ``verify``); xxh3-128 runs at memory speed, so neither
the write nor the check is bound by it. A shard the engine's worker fills in place is written a chunk at a time,
in no fixed order, so its checksum (`CHUNKED`) is taken over its chunks' digests, each computed from memory as
the chunk is written: nothing is read back.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

#: The checksum a new shard record carries, under this key.
CHECKSUM = "xxh3_128"
#: The checksum of a shard filled in place: xxh3-128 over the xxh3-128 digests (16 bytes each, `chunk_digest`) of
#: the file's consecutive `CHUNK`-byte chunks, the last one shorter.
CHUNKED = "xxh3_128_chunks"
#: The bytes of a chunk of `CHUNKED`.
CHUNK = 1 << 20
HASHES = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
#: Every checksum a shard record may carry.
CHECKSUMS = (*HASHES, CHUNKED)


def recorded_checksum(record: dict[str, Any]) -> str | None:
    """The name of the checksum a shard record carries (one of `CHECKSUMS`), or None."""
    return next((name for name in CHECKSUMS if name in record), None)


def chunk_digest(data: Any) -> bytes:
    """The digest of one chunk's bytes (any buffer) that `CHUNKED` is taken over."""
    return xxhash.xxh3_128_digest(data)


def file_checksum(path: Path, name: str = CHECKSUM, known: Mapping[int, bytes] | None = None) -> str:
    """The hex digest ``name`` of the file at ``path``; for `CHUNKED`, chunk ``i``'s digest is ``known[i]`` where
    given (computed as the chunk was written), the others read from the file."""
    known = known or {}
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else None  # the page cache
        view = memoryview(mapped if mapped is not None else b"")
        try:
            if name != CHUNKED:
                digest = HASHES[name]()
                digest.update(view)
                return digest.hexdigest()
            chunks = range(-(-size // CHUNK))
            digests = [known.get(i) or chunk_digest(view[i * CHUNK : (i + 1) * CHUNK]) for i in chunks]
            return xxhash.xxh3_128_hexdigest(b"".join(digests))
        finally:
            view.release()
            if mapped is not None:
                mapped.close()
