"""A damaged vLLM compile cache never blocks an engine start.

vLLM keeps what it compiled under ``VLLM_CACHE_ROOT/torch_compile_cache``, one entry (a directory) per
model and settings. An engine stopped while it compiles can leave an artifact of an entry empty or cut
short (a 0-byte ``.so``), and every later start of the same model and settings then fails as it loads
it (``InductorError: ImportError: ... main.so: file too short``), whatever process the engine runs in.
`start_recompiling_once` starts an engine; if the start fails and the cache holds a damaged artifact,
it removes that artifact's entry, says so in one log line, and starts once more (vLLM compiles again).
An artifact that torch's compiler is writing at that moment (its lock is held) is left alone.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

Started = TypeVar("Started")

#: The size of the ELF header of a 64-bit and of a 32-bit shared object.
_ELF_HEADER = {2: 64, 1: 52}


def start_recompiling_once(start: Callable[[], Started], root: Path | None = None) -> Started:
    """``start()``; where it fails and the compile cache at ``root`` (vLLM's by default) holds a damaged artifact,
    remove the artifact's entry (one log line each) and ``start()`` once more. Any other failure is raised as
    it is."""
    try:
        return start()
    except Exception:
        if not remove_damaged_entries(root):
            raise
    _release_in_process_engine()
    return start()


def compile_cache_root() -> Path:
    """Where vLLM keeps what it compiled."""
    from vllm import envs

    return Path(envs.VLLM_CACHE_ROOT) / "torch_compile_cache"


def remove_damaged_entries(root: Path | None = None) -> list[Path]:
    """Remove every entry of the compile cache at ``root`` (vLLM's by default) that holds a damaged artifact."""
    root = root or compile_cache_root()
    removed: dict[Path, str] = {}
    for artifact in sorted(root.rglob("*")) if root.is_dir() else []:
        entry = _entry(artifact, root)
        if entry in removed or entry == artifact or artifact.parent.name == "locks" or not artifact.is_file():
            continue
        reason = damage(artifact)
        if reason is not None and not _being_written(artifact, entry):
            removed[entry] = f"{artifact.relative_to(entry)}: {reason}"
    for entry, why in removed.items():
        shutil.rmtree(entry, ignore_errors=True)
        logger.warning("removed vLLM's compile-cache entry %s (damaged: %s); compiling it again", entry, why)
    return list(removed)


def damage(artifact: Path) -> str | None:
    """How a compiled artifact is damaged (empty, or a shared object cut short), or ``None``."""
    size = artifact.stat().st_size
    if size == 0:
        return "empty"
    if artifact.suffix != ".so":
        return None
    with open(artifact, "rb") as handle:
        header = handle.read(64)
    if header[:4] != b"\x7fELF" or header[4] not in _ELF_HEADER or len(header) < _ELF_HEADER[header[4]]:
        return "not a whole shared object (no ELF header)"
    order = "little" if header[5] == 1 else "big"
    wide = header[4] == 2
    offset = int.from_bytes(header[0x28:0x30] if wide else header[0x20:0x24], order)
    entry_size = int.from_bytes(header[0x3A:0x3C] if wide else header[0x2E:0x30], order)
    entries = int.from_bytes(header[0x3C:0x3E] if wide else header[0x30:0x32], order)
    if offset + entry_size * entries > size:
        return f"cut short ({size} bytes; its section table ends at byte {offset + entry_size * entries})"
    return None


def _entry(artifact: Path, root: Path) -> Path:
    """The cache entry ``artifact`` belongs to: ``root/<hash>`` or ``root/torch_aot_compile/<hash>``."""
    parts = artifact.relative_to(root).parts
    depth = 2 if parts[0] == "torch_aot_compile" else 1
    return root.joinpath(*parts[:depth]) if len(parts) > depth else artifact


def _being_written(artifact: Path, entry: Path) -> bool:
    """Whether torch's compiler holds the lock of ``artifact`` (it is writing it now, in another engine)."""
    key = artifact.name.split(".", 1)[0]
    for lock in entry.rglob(f"locks/{key}.lock"):
        with open(lock, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
    return False


def _release_in_process_engine() -> None:
    """Free what a failed in-process engine start left set up in this process (vLLM's distributed groups)."""
    from vllm import envs

    if not envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
