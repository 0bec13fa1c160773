"""Shard checksums: xxh3-128 for the shards this version writes, sha256 still checked for older harvests'.

A checksum is computed once, over the bytes as a layout writes them, and recomputed from
the file only to check a shard (a resume, ``verify``); xxh3-128 runs at memory speed, so neither
the write nor the check is bound by it.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path
from typing import Any

import xxhash

#: The checksum a new shard record carries, under this key.
CHECKSUM = "xxh3_128"
HASHES = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}


def recorded_checksum(record: dict[str, Any]) -> str | None:
    """The name of the checksum a shard record carries (``xxh3_128``, or ``sha256`` in older harvests), or None."""
    return next((name for name in HASHES if name in record), None)


def file_checksum(path: Path, name: str = CHECKSUM) -> str:
    """The hex digest ``name`` of the file at ``path``."""
    digest = HASHES[name]()
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size:
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:  # the page cache, not a copy
                digest.update(mapped)
    return digest.hexdigest()
