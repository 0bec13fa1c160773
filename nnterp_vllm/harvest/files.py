"""Local files written atomically and durably: under a temporary name unique to the writer, fsynced, renamed, the
directory fsynced; after a power loss or a crash a file is there whole or not at all, never empty or torn."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any


def staging(path: Path) -> Path:
    """A temporary name next to ``path``, unique to this process (and call)."""
    return path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def write_all(descriptor: int, buffer: memoryview) -> None:
    """Write all of ``buffer`` at the descriptor's position."""
    while len(buffer):
        buffer = buffer[os.write(descriptor, buffer) :]


def fsync_path(path: Path, directory: bool = False) -> None:
    """Flush ``path`` (a file, or a ``directory``'s entries) to the disk."""
    descriptor = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def durable(temporary: Path, path: Path) -> None:
    """Make the written file ``temporary`` the file ``path`` for good: fsync it, rename it, fsync the directory."""
    fsync_path(temporary)
    os.replace(temporary, path)
    fsync_path(path.parent, directory=True)


def write_parts(path: Path, parts: list[Any]) -> None:
    """Write ``parts`` (buffers) back to back as the file ``path``, atomically and durably (`durable`); a failure
    leaves nothing behind."""
    temporary = staging(path)
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for part in parts:
                write_all(descriptor, memoryview(part).cast("B"))
        finally:
            os.close(descriptor)
        durable(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def json_bytes(content: dict[str, Any], sort_keys: bool = True) -> bytes:
    """``content`` as the JSON text a harvest writes."""
    return json.dumps(content, indent=2, sort_keys=sort_keys).encode()


def write_json(path: Path, content: dict[str, Any], sort_keys: bool = True) -> None:
    """Write ``content`` as JSON at ``path``, atomically and durably."""
    write_parts(path, [json_bytes(content, sort_keys)])
