"""The output directory of a harvest: shards and a JSON manifest, written atomically and durably.

A directory (a local one, or a prefix on an object store: `location`) holds ``manifest.json`` and one file per
shard, in the harvest's layout (`layouts`: ``shard-NNNNN.safetensors`` files, or the arrow files of a SAELens
dataset). Each shard holds, for its tokens in corpus order, ``token_ids``, ``documents`` (the document each token
came from), ``offsets`` (its position in that document), ``rows`` (the context row it was run in) and one tensor
per harvested value, and its own record (`layouts.OWN`). On a local disk a shard is written under a temporary
name, fsynced, renamed, and the directory fsynced; the manifest is rewritten the same way after every shard, so a
run killed at any moment, or a power loss, leaves only whole shards and a whole manifest behind, and the next run
picks up after them. On a store each is one object, visible only once whole.

A run holds an exclusive lock on a local directory (``.lock``, through ``flock``), so a second writer is refused;
temporary files carry the writing process's id. A rerun trusts nothing it has not checked: every recorded shard is
checked (locally its existence, size and checksum; on a store one HEAD: its size and the checksum in its
metadata), a bad one recomputed, and each shard's record carries a digest of the corpus read up to it, so a
corpus edited since is refused with the shard where it first differs. A manifest lost or damaged is rebuilt from
the shards' own records (those made with this run's settings), never silently replaced.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..checksums import (
    CHECKSUM,
    CHECKSUMS,
    CHUNKED,
    file_checksum,
    recorded_checksum,
)
from .files import durable, json_bytes, staging
from .layouts import OWN_BYTES, Columns, SaeLens, Safetensors, layout_of, parts_checksum, read_own
from .location import CHECKSUM_KEY, Location
from .streamed import StreamedShard

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


def read_manifest(directory: Location | Path | str) -> dict[str, Any]:
    """The manifest of the harvest in ``directory``; HarvestError naming the file and the fix if it is damaged."""
    location = directory if isinstance(directory, Location) else Location.of(directory)
    path = location.path(MANIFEST)
    try:
        text = location.read_bytes(MANIFEST).decode("utf-8")
    except FileNotFoundError:
        raise HarvestError(f"{location} holds no harvest: {MANIFEST} is missing") from None
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


def _damaged(path: str, what: str) -> HarvestError:
    return HarvestError(
        f"{path} is damaged ({what}), so the shards beside it cannot be trusted: restore the file from a copy, "
        f"or rerun the harvest with {OVERWRITE} to compute them again"
    )


def shard_problem(directory: Location | Path, record: dict[str, Any]) -> str | None:
    """What is wrong with the shard ``record`` describes (missing, wrong size, other checksum), or None: locally
    from its bytes; on a store from one HEAD (its size, and the checksum its metadata carries)."""
    location = directory if isinstance(directory, Location) else Location.of(directory)
    found = location.head(record["file"])
    if found is None:
        return "missing"
    size, metadata = found
    if size != record["bytes"]:
        kind = "truncated" if size < record["bytes"] else "too long"
        return f"{kind}: {size} bytes, the manifest records {record['bytes']}"
    checksum = recorded_checksum(record)
    if location.local is None:
        if metadata.get(CHECKSUM_KEY) != f"{checksum}:{record[checksum]}":
            return "damaged: the checksum in its metadata differs from the manifest's"
    elif file_checksum(location.local / record["file"], checksum) != record[checksum]:
        return "damaged: its checksum differs from the manifest's"
    return None


def settings_digest(settings: dict[str, Any]) -> str:
    """A digest of the settings a shard's content follows from (`SETTINGS`), which its own record carries."""
    return hashlib.sha256(json.dumps({key: settings.get(key) for key in SETTINGS}, sort_keys=True).encode()).hexdigest()


def own_record(record: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """What a shard carries of itself (`layouts.OWN`): its record, and the digest of its settings."""
    return {"record": record, "settings": settings_digest(settings)}


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

    Use as a context manager: entering creates a local directory, takes its lock and reads any manifest (on a
    store: checks the bucket is there); `begin` compares the settings and checks the recorded shards; leaving
    releases the lock, and removes a local directory again if this run created it and wrote nothing.
    """

    def __init__(self, out: Location | Path | str, overwrite: bool = False) -> None:
        self.location = out if isinstance(out, Location) else Location.of(out)
        self.out = self.location.local if self.location.local is not None else self.location.url
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
        local = self.location.local
        if local is None:
            self.location.check_reachable()
        else:
            self.created = not local.exists()
            try:
                local.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise HarvestError(f"cannot create the output directory {local}: {error.strerror or error}") from error
        try:
            if local is not None:
                self._lock = _lock(local)
            if self.location.exists(MANIFEST):
                try:
                    self.existing = read_manifest(self.location)
                except HarvestError as error:
                    if not self.overwrite and not self._own_records():
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
        local = self.location.local
        if local is not None and self.created and not self.saved:
            (local / LOCK).unlink(missing_ok=True)
            try:
                local.rmdir()
            except OSError:
                pass  # something else was put there meanwhile: leave it

    def _shard_files(self) -> list[str]:
        return self.location.names(("shard-*.safetensors", "data-*.arrow"))

    def _own_records(self) -> list[tuple[str, int, dict[str, Any]]]:
        """Each shard file here that carries its own record: its name, size and that record."""
        found = []
        for name in self._shard_files():
            head = self.location.head(name)
            if head is None:
                continue
            own = read_own(self.location.read_range(name, 0, min(head[0], OWN_BYTES)))
            if isinstance(own, dict) and isinstance(own.get("record"), dict) and "settings" in own:
                found.append((name, head[0], own))
        return found

    def _recovered(self, settings: dict[str, Any]) -> dict[str, Any] | None:
        """A manifest rebuilt from the shards' own records made with ``settings`` (`own_record`), or None where no
        shard carries one; HarvestError where one was made with other settings."""
        owned = self._own_records()
        if not owned:
            return None
        digest = settings_digest(settings)
        others = [name for name, _, own in owned if own["settings"] != digest]
        if others:
            raise HarvestError(
                f"{self.location} holds shards made with other settings ({others[0]} ...) and no readable manifest; "
                f"use another --out directory, or {OVERWRITE} to replace them"
            )
        shards = {}
        for name, size, own in owned:
            record = {**own["record"], "file": name, "bytes": size}
            if self.location.local is not None:
                record[CHECKSUM] = file_checksum(self.location.local / name)
            else:
                checksum, _, value = self.location.head(name)[1].get(CHECKSUM_KEY, "").partition(":")
                if not value:
                    continue  # an object without its checksum: computed again
                record[checksum] = value
            shards[str(record["index"])] = record
        why = self._damaged or "no manifest"
        log.warning("%s: %s; rebuilt it from the %d shards' own records", self.location, why, len(shards))
        return {**settings, "shards": shards, "complete": False}

    def begin(self, settings: dict[str, Any]) -> None:
        """Start or continue the harvest with ``settings``: refuse other settings, drop shards that fail their check."""
        existing = self.existing
        if existing is None and not self.overwrite and (self._damaged is not None or self._shard_files()):
            existing = self._recovered(settings)
            if existing is None and self._damaged is not None:
                raise self._damaged
        if existing is not None and not self.overwrite:
            if version(existing) not in RESUMABLE and existing is self.existing:
                raise HarvestError(
                    f"{self.location.path(MANIFEST)} was written by an older nnterp_vllm (layout version "
                    f"{version(existing)}), which recorded no corpus digests to resume by; use another --out "
                    f"directory, or {OVERWRITE} to harvest again"
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
                    f"{self.location} holds a harvest made with other settings:\n"
                    + "\n".join(lines)
                    + f"\nUse another --out directory, or {OVERWRITE} to replace it."
                )
        if self.overwrite and (existing is not None or self._damaged is not None):
            self._clear()
            existing = None
        for leftover in self.location.names(("*.tmp",)):
            self.location.remove(leftover)
        self.manifest = existing or {**settings, "shards": {}, "complete": False}
        self.manifest["version"] = VERSION  # what the records added from now on need to be read
        self.settings = {key: self.manifest.get(key, settings[key]) for key in settings}
        self.recorded = {int(index): record for index, record in self.manifest["shards"].items()}
        self.recorded_complete = bool(self.manifest.get("complete"))
        for index, record in sorted(self.recorded.items()):
            problem = shard_problem(self.location, record)
            if problem is not None:
                log.warning("%s in %s is %s; recomputing it", record["file"], self.location, problem)
                self.location.remove(record["file"])
                del self.manifest["shards"][str(index)]
                self.manifest["complete"] = False

    def _clear(self) -> None:
        for name in self.location.names((*Safetensors.patterns, *SaeLens.patterns)):
            self.location.remove(name)
        self.location.remove(MANIFEST)

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
            layout_of(self.manifest).publish(self.location, list(self.manifest["shards"].values()))
            self.location.write_bytes(MANIFEST, json_bytes(self.manifest))
        except OSError as error:
            raise HarvestError(f"cannot write the manifest in {self.location}: {error.strerror or error}") from error
        self.saved = True


@dataclass(frozen=True)
class Placed:
    """A shard filled in place: its file (as `place_shard` began it, or the memory file of ``upload``, bound for a
    store) and the digests of the chunks its writer hashed as it wrote them, by chunk (`checksums.CHUNKED`; the
    other chunks are read from the file)."""

    path: Path
    digests: dict[int, bytes]
    upload: StreamedShard | None = None


def write_shard(
    out: Location | Path | str,
    index: int,
    columns: Columns,
    record: dict[str, Any],
    settings: dict[str, Any],
    placed: Placed | None = None,
) -> dict[str, Any]:
    """Write one shard in the layout ``settings`` name, carrying its own record (`own_record`), visible only once
    whole (locally: a temporary name, fsynced, renamed, the directory fsynced; on a store: one object, its checksum
    in its metadata); a failed write leaves nothing behind. A shard filled in place (``placed``, local) is only
    checksummed (`checksums.CHUNKED`), fsynced and renamed; one bound for a store is sent (`StreamedShard.finish`)."""
    location = out if isinstance(out, Location) else Location.of(out)
    layout = layout_of(settings)
    name = layout.file_name(index)
    try:
        if placed and placed.upload:
            checksum, digest, size = CHUNKED, placed.upload.finish(placed.digests), placed.upload.size
        elif placed:
            with _removed_on_failure(placed.path):
                checksum, digest = CHUNKED, file_checksum(placed.path, CHUNKED, placed.digests)
                durable(placed.path, location.local / name)
            size = (location.local / name).stat().st_size
        else:
            parts = layout.parts(columns, own_record(record, settings))
            checksum, digest = CHECKSUM, parts_checksum(parts)
            location.write_parts(name, parts, {CHECKSUM_KEY: f"{CHECKSUM}:{digest}"})
            size = sum(memoryview(part).nbytes for part in parts)
    except OSError as error:
        raise _unwritable(name, location, error) from error
    return {**record, "file": name, "bytes": size, checksum: digest}


def place_shard(
    out: Path, index: int, columns: Columns, room: list[tuple[str, Any, list[int]]], own: dict[str, Any]
) -> tuple[Path, int]:
    """Begin shard ``index`` of a safetensors harvest in the local directory ``out`` with its values to be filled in
    place (`Safetensors.place`: ``columns`` and ``own`` written, the disk space for ``room`` taken now), under a
    temporary name that `write_shard` renames: that file and the byte its room starts at. A failure leaves nothing
    behind."""
    path = Path(out) / Safetensors.file_name(index)
    temporary = staging(path)
    try:
        with _removed_on_failure(temporary):
            return temporary, Safetensors.place(temporary, columns, room, own)
    except OSError as error:
        raise _unwritable(path.name, path.parent, error) from error


def stream_shard(
    location: Location, index: int, columns: Columns, room: list[tuple[str, Any, list[int]]], own: dict[str, Any]
) -> tuple[StreamedShard, int]:
    """Begin shard ``index`` of a safetensors harvest bound for the store ``location``, its values to be filled in
    place in memory and sent as they are (`StreamedShard`; ``columns``, ``room``, ``own`` as `place_shard` takes
    them): the shard and the byte its room starts at. A failure leaves nothing behind."""
    upload = StreamedShard(location, Safetensors.file_name(index))
    try:
        start = Safetensors.place(upload.path, columns, room, own, reserve=False)
        upload.begin()
    except BaseException as error:
        upload.abort()
        if isinstance(error, OSError):
            raise _unwritable(upload.name, location, error) from error
        raise
    return upload, start


def _unwritable(name: str, where: Any, error: OSError) -> HarvestError:
    return HarvestError(
        f"cannot write {name} in {where}: {error.strerror or error}. The partial file was removed; "
        "free space (or fix permissions) and rerun the same command to resume."
    )


@contextlib.contextmanager
def _removed_on_failure(temporary: Path) -> Iterator[None]:
    """Remove ``temporary`` if the block fails."""
    try:
        yield
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
