"""Where a harvest lives: a local directory, or any fsspec URL (``s3://``, ``gs://``, ``az://``, ``file://``, ...).

A local path (or a ``file://`` URL) is a directory on this machine: written through the page cache, each file
fsynced before its rename and the directory after it (`durable`). Any other URL is an object store (or another
file system fsspec serves), reached through fsspec with the store's usual credentials and endpoint (for S3,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``, profiles, as boto3 reads
them) or ``storage_options``; neither is ever written to a manifest or a log line. An object is visible only
once whole: an object store's put (a multipart upload is completed at once), elsewhere a temporary name then a
move (`ATOMIC_PUT`). A shard's checksum rides in its object's metadata (`CHECKSUM_KEY`), so a resume checks a
recorded shard with one HEAD (`Location.head`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .files import staging, write_parts

#: Protocols whose put makes an object visible only once whole (object stores); elsewhere a temporary name is
#: written and moved.
ATOMIC_PUT = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory")
#: The user-metadata key under which a shard object carries its checksum (``name:hex``).
CHECKSUM_KEY = "nnterp-checksum"
#: Bytes of each part a shard is uploaded in (S3 takes parts of 5 MiB to 5 GiB).
PART_BYTES = 16 * 2**20
#: Parts of one object on their way to S3 at once: the memory an upload holds is this many parts.
PARTS_AT_ONCE = 4


def is_url(out: Any) -> bool:
    """Whether ``out`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(out, str) and "://" in out


@dataclass
class Location:
    """A harvest's directory: ``local`` on this machine, or ``root`` on the fsspec file system ``fs``.

    ``url`` is what the caller gave (for messages: it carries no credentials, which only ``storage_options``
    and the environment hold).
    """

    url: str
    local: Path | None = None
    fs: Any = None
    root: str = ""
    protocol: str = "file"
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, out: Path | str, storage_options: dict[str, Any] | None = None) -> Location:
        """The location ``out`` names; ValueError naming the URL and the fix where no file system serves it."""
        options = dict(storage_options or {})
        if not is_url(out):
            if options:
                raise ValueError(f"storage_options are for a URL --out (s3://, gs://, ...); {out!r} is a local path")
            return cls(str(out), local=Path(out))
        import fsspec
        from fsspec.core import url_to_fs

        protocol = str(out).split("://", 1)[0]
        if protocol == "file":
            return cls(str(out), local=Path(str(out).removeprefix("file://")))
        try:
            fs, root = url_to_fs(str(out), **options)
        except ImportError as error:
            raise ValueError(
                f"--out {out!r}: the {protocol}:// file system needs a package that is not installed ({error}); "
                "install it (for s3://: pip install 'nnterp_vllm[store]') or write to a local directory"
            ) from None
        except ValueError as error:
            known = ", ".join(sorted(p for p in fsspec.available_protocols() if len(p) > 1))
            raise ValueError(f"--out {out!r}: {error}; fsspec serves {known}, or give a local directory") from None
        return cls(str(out), fs=fs, root=root.rstrip("/"), protocol=protocol, storage_options=options)

    def __str__(self) -> str:
        return self.url

    def path(self, name: str) -> str:
        """The path of the file ``name`` in this directory (local, or on the file system)."""
        return str(self.local / name) if self.local is not None else posixpath.join(self.root, name)

    def check_reachable(self) -> None:
        """Refuse a store whose bucket (or container) does not exist or cannot be reached, before any work."""
        if self.local is not None:
            return
        bucket = self.root.split("/", 1)[0]
        try:
            found = self.fs.exists(bucket)
        except Exception as error:  # the store's own error: credentials, endpoint, network
            raise OSError(f"cannot reach {self.protocol}://{bucket} for --out {self.url}: {error}") from None
        if not found:
            raise OSError(
                f"the bucket {self.protocol}://{bucket} of --out {self.url} does not exist (or these credentials "
                "cannot see it): create it first, or check AWS_ENDPOINT_URL / storage_options"
            )

    # -- files, on the store ------------------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        """Whether ``name`` is there now (on a store, asked of the store: no listing cached earlier is trusted, as
        replicas elsewhere write here too)."""
        if self.local is not None:
            return os.path.exists(self.path(name))
        self.fs.invalidate_cache(self.root)
        return self.fs.exists(self.path(name))

    def read_bytes(self, name: str) -> bytes:
        """The bytes of ``name``; FileNotFoundError where it is missing."""
        if self.local is not None:
            return (self.local / name).read_bytes()
        return self.fs.cat_file(self.path(name))

    def read_range(self, name: str, start: int, stop: int) -> bytes:
        """Bytes ``start:stop`` of ``name``."""
        if self.local is not None:
            with open(self.local / name, "rb") as handle:
                handle.seek(start)
                return handle.read(stop - start)
        return self.fs.cat_file(self.path(name), start=start, end=stop)

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write ``name`` whole, visible only once complete (locally: a temporary file, fsynced, renamed, the
        directory fsynced)."""
        self.write_parts(name, [memoryview(data)])

    def write_parts(self, name: str, parts: Sequence[Any], metadata: dict[str, str] | None = None) -> None:
        """Write ``parts`` (buffers) back to back as ``name``, visible only once whole: locally through a
        temporary file (`durable`); on a store streamed as a multipart upload of `PART_BYTES` parts with
        ``metadata`` as the object's user metadata, under a temporary name then moved where the store's put
        is not atomic. A failure leaves nothing behind."""
        if self.local is not None:
            write_parts(self.local / name, list(parts))
            return
        target = self.path(name)
        if self.protocol in ("s3", "s3a"):
            self._s3_upload(target, parts, metadata or {})
            return
        atomic = self.protocol in ATOMIC_PUT
        written = target if atomic else f"{target}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        extra = self.metadata_arguments(metadata) if metadata else {}
        handle = self.fs.open(written, "wb", block_size=PART_BYTES, **extra)
        try:
            for part in parts:
                handle.write(memoryview(part).cast("B"))
        except BaseException:
            with contextlib.suppress(Exception):
                getattr(handle, "discard", lambda: None)()  # an upload begun is aborted, never completed
            with contextlib.suppress(Exception):
                handle.close()
            if not atomic:
                with contextlib.suppress(Exception):
                    self.fs.rm_file(written)
            raise
        handle.close()
        if not atomic:
            self.fs.mv(written, target)

    def _s3_upload(self, target: str, parts: Sequence[Any], metadata: dict[str, str]) -> None:
        """``parts`` as the S3 object ``target`` with ``metadata``: one put where they fit in a part, else a multipart
        upload of `PART_BYTES` parts, `PARTS_AT_ONCE` on their way at once, completed (the object appears whole)
        once all are up, aborted on a failure (nothing appears)."""
        from fsspec.asyn import sync

        bucket, key = target.split("/", 1)
        views = [memoryview(part).cast("B") for part in parts]
        extra = {"Metadata": metadata} if metadata else {}
        if sum(view.nbytes for view in views) <= PART_BYTES:
            self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"".join(views), **extra)
        else:
            sync(self.fs.loop, _multipart_upload, self.fs, bucket, key, views, extra)
        self.fs.invalidate_cache(target)

    def metadata_arguments(self, metadata: dict[str, str]) -> dict[str, Any]:
        """How this store's file system takes an object's user metadata on ``open``."""
        if self.protocol in ("s3", "s3a"):
            return {"Metadata": metadata}
        if self.protocol in ("gs", "gcs", "az", "abfs", "abfss"):
            return {"metadata": metadata}
        return {}

    def head(self, name: str) -> tuple[int, dict[str, str]] | None:
        """The size and user metadata of ``name`` in one request (``None`` where it is missing)."""
        if self.local is not None:
            try:
                return os.stat(self.path(name)).st_size, {}
            except FileNotFoundError:
                return None
        path = self.path(name)
        try:
            if self.protocol in ("s3", "s3a"):
                bucket, key = path.split("/", 1)
                answer = self.fs.call_s3("head_object", Bucket=bucket, Key=key)
                return int(answer["ContentLength"]), {k.lower(): v for k, v in (answer.get("Metadata") or {}).items()}
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        return int(info["size"]), dict(info.get("metadata") or {})

    def names(self, patterns: Sequence[str]) -> list[str]:
        """The names in this directory matching any of ``patterns`` (globs)."""
        if self.local is not None:
            return sorted({path.name for pattern in patterns for path in self.local.glob(pattern)})
        self.fs.invalidate_cache(self.root)
        found = {posixpath.basename(path) for pattern in patterns for path in self.fs.glob(self.path(pattern))}
        return sorted(found)

    def remove(self, name: str) -> None:
        """Remove ``name`` if it is there."""
        if self.local is not None:
            Path(self.path(name)).unlink(missing_ok=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.path(name))

    def download(self, name: str, target: Path) -> None:
        """Copy ``name`` to the local file ``target`` (through a temporary name)."""
        temporary = staging(target)
        try:
            self.fs.get_file(self.path(name), str(temporary))
            os.replace(temporary, target)
        finally:
            temporary.unlink(missing_ok=True)


def pieces(views: Sequence[memoryview], size: int, spare: list[bytearray] | None = None) -> Iterator[bytearray]:
    """The bytes of ``views`` back to back, in pieces of ``size`` (the last one shorter), each copied once, as it is
    asked for, into a buffer taken from ``spare`` where one is there (memory already touched fills fastest), else a
    new one (S3's client takes a part as bytes or a bytearray, not a view)."""
    spare = spare if spare is not None else []

    def buffer() -> bytearray:
        return spare.pop() if spare else bytearray(size)

    piece, filled = buffer(), 0
    for view in views:
        while view.nbytes:
            take = min(size - filled, view.nbytes)
            piece[filled : filled + take] = view[:take]
            filled, view = filled + take, view[take:]
            if filled == size:
                yield piece
                piece, filled = buffer(), 0
    if filled:
        del piece[filled:]
        yield piece


async def _multipart_upload(fs: Any, bucket: str, key: str, views: Sequence[memoryview], extra: dict) -> None:
    """An S3 multipart upload of ``views`` through s3fs's client (see `Location._s3_upload`)."""
    upload = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key, **extra)
    common = {"Bucket": bucket, "Key": key, "UploadId": upload["UploadId"]}

    spare: list[bytearray] = []  # the bodies of parts sent, for the next ones

    async def send(number: int, body: bytearray) -> dict[str, Any]:
        sent = await fs._call_s3("upload_part", PartNumber=number, Body=body, **common)
        if len(body) == PART_BYTES:
            spare.append(body)
        return {"PartNumber": number, "ETag": sent["ETag"]}

    done: list[dict[str, Any]] = []
    pending: set[asyncio.Task] = set()
    try:
        for number, body in enumerate(pieces(views, PART_BYTES, spare), 1):
            if len(pending) >= PARTS_AT_ONCE:
                finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                done += [task.result() for task in finished]
            pending.add(asyncio.ensure_future(send(number, body)))
        done += await asyncio.gather(*pending)
        pending = set()
        parts = sorted(done, key=lambda part: part["PartNumber"])
        await fs._call_s3("complete_multipart_upload", MultipartUpload={"Parts": parts}, **common)
    except BaseException:
        for task in pending:
            task.cancel()
        with contextlib.suppress(Exception):
            await fs._call_s3("abort_multipart_upload", **common)
        raise


__all__ = ["ATOMIC_PUT", "CHECKSUM_KEY", "PART_BYTES", "Location", "is_url"]
