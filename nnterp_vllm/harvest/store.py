"""The output directory of a harvest: shards and a JSON manifest, written atomically, held by one writer.

A directory holds ``manifest.json`` and one file per shard, in the harvest's layout
(`layouts`: ``shard-NNNNN.safetensors`` files, or the arrow files of a SAELens dataset). Each
shard holds, for its tokens in corpus order, ``token_ids``, ``documents`` (the document each
token came from), ``offsets`` (its position in that document), ``rows`` (the context row it
was run in) and one tensor per harvested value. A shard is written under a temporary name and
renamed; the manifest is rewritten (also by rename) after every shard, so a run killed at any
moment leaves only whole shards behind, and the next run picks up after them.

A run holds an exclusive lock on the directory (``.lock``, through ``flock``), so a second
writer is refused; temporary files carry the writing process's id. A rerun trusts nothing it
has not checked: every recorded shard is checked for existence, size and checksum (a bad one
is recomputed), and each shard's record carries a digest of the corpus read up to it, so a
corpus edited since is refused with the shard where it first differs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .checksums import CHECKSUM, CHECKSUMS, CHUNKED, file_checksum, recorded_checksum
from .files import staging, write_json
from .layouts import Columns, SaeLens, Safetensors, layout_of

MANIFEST = "manifest.json"
LOCK = ".lock"
#: The manifest's layout version; this version writes 3 and reads 1 to 3. Version 3 records
#: xxh3-128 shard checksums (version 2 recorded sha256, still checked: a version-2 harvest resumes).
VERSION = 3
READABLE = (1, 2, 3)
#: Versions whose shard records carry the corpus digests a resume checks.
RESUMABLE = (2, 3)
#: Manifest keys that must match for a run to continue a directory.
SETTINGS = (
    "model",
    "config_hash",
    "engine",
    "attention",
    "dtype",
    "format",
    "values",
    "positions",
    "context",
    "shard_bytes",
)
#: Manifest keys that must match where the directory recorded them (one written before they were resumes).
RECORDED_SETTINGS = ("model_dtype",)
RECORD_KEYS = ("index", "file", "bytes", "tokens")
OVERWRITE = "overwrite=True (--overwrite)"

log = logging.getLogger("nnterp_vllm.harvest")


class HarvestError(RuntimeError):
    """A harvest that cannot start or go on: other settings in the directory, an unwritable output."""


def positive_int(value: Any, what: str) -> int:
    """``value`` if it is a positive int (not a bool), else ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def version(manifest: dict[str, Any]) -> int:
    """The manifest's layout version (version 1 spelled it ``format``)."""
    return manifest.get("version", manifest.get("format") if isinstance(manifest.get("format"), int) else None)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of the harvest in ``directory``; HarvestError naming the file and the fix if it is damaged."""
    path = Path(directory) / MANIFEST
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise HarvestError(f"{directory} holds no harvest: {MANIFEST} is missing") from None
    except OSError as error:
        raise HarvestError(f"cannot read {path}: {error.strerror or error}") from error
    except UnicodeDecodeError as error:
        raise _damaged(path, f"not UTF-8 text at byte {error.start}") from error
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as error:
        raise _damaged(path, f"{error.msg}: line {error.lineno}, column {error.colno}") from error
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), dict):
        raise _damaged(path, "not a harvest manifest: no 'shards' table")
    if version(manifest) not in READABLE:
        raise HarvestError(
            f"{path} has layout version {version(manifest)!r}; this nnterp_vllm reads versions {READABLE}"
        )
    for key, record in manifest["shards"].items():
        if not isinstance(record, dict) or any(name not in record for name in RECORD_KEYS):
            raise _damaged(path, f"the record of shard {key!r} lacks one of {RECORD_KEYS}")
        if recorded_checksum(record) is None:
            raise _damaged(path, f"the record of shard {key!r} carries no checksum (one of {CHECKSUMS})")
    return manifest


def _damaged(path: Path, what: str) -> HarvestError:
    return HarvestError(
        f"{path} is damaged ({what}), so the shards beside it cannot be trusted: restore the file from a copy, "
        f"or rerun the harvest with {OVERWRITE} to compute them again"
    )


def shard_problem(directory: Path, record: dict[str, Any]) -> str | None:
    """What is wrong with the shard ``record`` describes (missing, wrong size, other checksum), or None."""
    path = Path(directory) / record["file"]
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        kind = "truncated" if size < record["bytes"] else "too long"
        return f"{kind}: {size} bytes, the manifest records {record['bytes']}"
    checksum = recorded_checksum(record)
    if file_checksum(path, checksum) != record[checksum]:
        return "damaged: its checksum differs from the manifest's"
    return None


def _lock(directory: Path) -> IO[str]:
    """Hold an exclusive lock on ``directory`` (its lock file); HarvestError if another process holds it."""
    handle = open(directory / LOCK, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        handle.seek(0)
        holder = handle.read().strip()
        handle.close()
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise HarvestError(f"cannot lock {directory / LOCK}: {error.strerror or error}") from error
        raise HarvestError(
            f"another harvest{f' (process {holder})' if holder else ''} is writing into {directory}; "
            "wait for it to finish, or choose another --out directory"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _unlock(handle: IO[str]) -> None:
    handle.seek(0)
    handle.truncate()
    fcntl.flock(handle, fcntl.LOCK_UN)
    handle.close()


class Store:
    """The output directory of one harvest, held exclusively: what is done, and the writing of what is next.

    Use as a context manager: entering creates the directory, takes its lock and reads any
    manifest; `begin` compares the settings and checks the recorded shards; leaving releases
    the lock, and removes the directory again if this run created it and wrote nothing.
    """

    def __init__(self, out: Path | str, overwrite: bool = False) -> None:
        self.out = Path(out)
        self.overwrite = overwrite
        self.created = False
        self.saved = False
        self.existing: dict[str, Any] | None = None
        self.manifest: dict[str, Any] = {}
        #: Every shard record the directory's manifest held on entry, checked or not.
        self.recorded: dict[int, dict[str, Any]] = {}
        self._lock: IO[str] | None = None
        self._damaged: HarvestError | None = None

    def __enter__(self) -> Store:
        self.created = not self.out.exists()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise HarvestError(f"cannot create the output directory {self.out}: {error.strerror or error}") from error
        try:
            self._lock = _lock(self.out)
            if (self.out / MANIFEST).exists():
                try:
                    self.existing = read_manifest(self.out)
                except HarvestError as error:
                    if not self.overwrite:
                        raise
                    self._damaged = error
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._lock is not None:
            _unlock(self._lock)
            self._lock = None
        if self.created and not self.saved:
            (self.out / LOCK).unlink(missing_ok=True)
            try:
                self.out.rmdir()
            except OSError:
                pass  # something else was put there meanwhile: leave it

    def begin(self, settings: dict[str, Any]) -> None:
        """Start or continue the harvest with ``settings``: refuse other settings, drop shards that fail their check."""
        existing = self.existing
        if existing is not None and not self.overwrite:
            if version(existing) not in RESUMABLE:
                raise HarvestError(
                    f"{self.out / MANIFEST} was written by an older nnterp_vllm (layout version {version(existing)}), "
                    f"which recorded no corpus digests to resume by; use another --out directory, or {OVERWRITE} "
                    "to harvest again"
                )
            different = [key for key in SETTINGS if existing.get(key) != settings.get(key)] + [
                key for key in RECORDED_SETTINGS if key in existing and existing[key] != settings.get(key)
            ]
            if different:
                lines = [
                    f"  {key}: directory has {existing.get(key)!r}, this run has {settings.get(key)!r}"
                    for key in different
                ]
                raise HarvestError(
                    f"{self.out} holds a harvest made with other settings:\n"
                    + "\n".join(lines)
                    + f"\nUse another --out directory, or {OVERWRITE} to replace it."
                )
        if self.overwrite and (existing is not None or self._damaged is not None):
            self._clear()
            existing = None
        for leftover in self.out.glob("*.tmp"):
            leftover.unlink()
        self.manifest = existing or {**settings, "shards": {}, "complete": False}
        self.manifest["version"] = VERSION  # what the records added from now on need to be read
        self.settings = {key: self.manifest.get(key, settings[key]) for key in settings}
        self.recorded = {int(index): record for index, record in self.manifest["shards"].items()}
        self.recorded_complete = bool(self.manifest.get("complete"))
        for index, record in sorted(self.recorded.items()):
            problem = shard_problem(self.out, record)
            if problem is not None:
                log.warning("%s in %s is %s; recomputing it", record["file"], self.out, problem)
                (self.out / record["file"]).unlink(missing_ok=True)
                del self.manifest["shards"][str(index)]
                self.manifest["complete"] = False

    def _clear(self) -> None:
        for pattern in (*Safetensors.patterns, *SaeLens.patterns):
            for path in self.out.glob(pattern):
                path.unlink()
        (self.out / MANIFEST).unlink(missing_ok=True)

    @property
    def done(self) -> set[int]:
        """The indices of the shards written and checked."""
        return {int(index) for index in self.manifest["shards"]}

    def add(self, index: int, record: dict[str, Any], stats: dict[str, Any]) -> None:
        """Record a written shard and the running totals, rewriting the manifest atomically."""
        self.manifest["shards"][str(index)] = record
        self.manifest["stats"] = stats
        self._save()

    def finish(self, stats: dict[str, Any], corpus_sha256: str) -> None:
        """Mark the harvest complete, with the digest of the whole corpus as read."""
        self.manifest["stats"] = stats
        self.manifest["corpus_sha256"] = corpus_sha256
        self.manifest["complete"] = True
        self._save()

    def _save(self) -> None:
        try:
            layout_of(self.manifest).publish(self.out, list(self.manifest["shards"].values()))
            write_json(self.out / MANIFEST, self.manifest)
        except OSError as error:
            raise HarvestError(f"cannot write the manifest in {self.out}: {error.strerror or error}") from error
        self.saved = True


@dataclass(frozen=True)
class Placed:
    """A shard filled in place: its file (as `place_shard` began it) and the digests of the chunks its writer hashed
    as it wrote them, by chunk (`checksums.CHUNKED`; the other chunks are read from the file)."""

    path: Path
    digests: dict[int, bytes]


def write_shard(
    out: Path,
    index: int,
    columns: Columns,
    record: dict[str, Any],
    settings: dict[str, Any],
    placed: Placed | None = None,
) -> dict[str, Any]:
    """Write one shard in the layout ``settings`` name, under a temporary name, then rename it; a failed write leaves
    nothing behind. A shard filled in place (``placed``) is only checksummed (`checksums.CHUNKED`) and renamed."""
    layout = layout_of(settings)
    path = Path(out) / layout.file_name(index)
    temporary = placed.path if placed else staging(path)
    with _removed_on_failure(temporary, path):
        if placed:
            checksum, digest = CHUNKED, file_checksum(temporary, CHUNKED, placed.digests)
        else:
            checksum, digest = CHECKSUM, layout.write(temporary, columns)
        os.replace(temporary, path)
    return {**record, "file": path.name, "bytes": path.stat().st_size, checksum: digest}


def place_shard(out: Path, index: int, columns: Columns, room: list[tuple[str, Any, list[int]]]) -> tuple[Path, int]:
    """Begin shard ``index`` of a safetensors harvest with its values to be filled in place (`Safetensors.place`:
    ``columns`` written, the disk space for ``room`` taken now), under a temporary name that `write_shard` renames:
    that file and the byte its room starts at. A failure leaves nothing behind."""
    path = Path(out) / Safetensors.file_name(index)
    temporary = staging(path)
    with _removed_on_failure(temporary, path):
        return temporary, Safetensors.place(temporary, columns, room)


@contextlib.contextmanager
def _removed_on_failure(temporary: Path, path: Path) -> Iterator[None]:
    """Remove ``temporary`` (shard file ``path`` being written) and raise a HarvestError saying so on an OSError."""
    try:
        yield
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise HarvestError(
            f"cannot write {path.name} in {path.parent}: {error.strerror or error}. The partial file was removed; "
            "free space (or fix permissions) and rerun the same command to resume."
        ) from error
