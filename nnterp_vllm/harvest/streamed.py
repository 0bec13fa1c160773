"""A safetensors shard bound for an object store, filled in memory by the engine's worker and sent part by part.

The shard's bytes live in an anonymous memory file laid out as its object will be (`layouts.Safetensors.place` writes
its header and columns there; the engine's worker fills its values in place, `engines.steered.shared_rows.Region`,
marking each whole chunk in a table once it is in the file). On S3, after each engine step the pipeline hands that table
to `StreamedShard.send_ready`: each part of `location.PART_BYTES` whose chunks are all final goes up at once as a part
of a multipart upload under the shard's own key, `location.PARTS_AT_ONCE` at a time, its memory given back as it goes (a
hole punched in the memory file), so a shard whose parts are finished as its requests are is never held whole.
`StreamedShard.finish` sends the rest (the header's part, the last one, any part the worker did not fill whole),
completes the upload, when the object appears whole at once, and then gives it its checksum (known only once every chunk
is) by copying the object onto itself with new metadata, which stores do without moving its bytes. An object that ends
up without that metadata (the run killed in between) fails a resume's HEAD and is computed again, as any other. On
another store, or an S3 object too large to copy in one request, the shard is sent whole by `finish`, its checksum in
the metadata it is created with. An error, or `StreamedShard.abort`, aborts the upload: nothing appears.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ..checksums import (
    CHUNK,
    CHUNKED,
    chunk_digest,
    file_checksum,
)
from .location import CHECKSUM_KEY, PART_BYTES, PARTS_AT_ONCE, Location

#: The largest object S3 copies onto itself in one request.
COPY_LIMIT = 5 * 2**30
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_libc = ctypes.CDLL(None, use_errno=True)


class StreamedShard:
    """Shard ``name`` of ``location`` (an object store), in a memory file at ``path`` until `finish` has sent it.

    `begin` once its bytes are laid out (`layouts.Safetensors.place` into ``path``); then `send_ready` after each
    engine step, and `finish` (or `abort`) once.
    """

    def __init__(self, location: Location, name: str) -> None:
        self.location = location
        self.name = name
        self.descriptor = os.memfd_create("nnterp-vllm-shard", os.MFD_CLOEXEC)
        self.path = Path(f"/proc/{os.getpid()}/fd/{self.descriptor}")
        self.size = 0
        #: The parts not sent yet, while the shard is streamed (none where it is sent whole).
        self.unsent: set[int] = set()
        self.sending: list[Future] = []
        #: The digests of the chunks sent, computed from the bytes sent.
        self.sent_digests: dict[int, bytes] = {}
        self.created: Future | None = None
        self.spare: list[bytearray] = []
        self.slots = asyncio.Semaphore(PARTS_AT_ONCE)

    def begin(self) -> None:
        """Start the upload of the laid-out shard where it is streamed (S3, more than one part, copyable)."""
        self.size = os.fstat(self.descriptor).st_size
        if self.location.protocol in ("s3", "s3a") and PART_BYTES < self.size <= COPY_LIMIT:
            self.bucket, self.key = self.location.path(self.name).split("/", 1)
            self.unsent = set(range(-(-self.size // PART_BYTES)))
            self.created = self._run(self._call("create_multipart_upload"))

    def send_ready(self, final: dict[int, bytes]) -> None:
        """Send each part not sent yet whose chunks are all in ``final`` (the worker's table: chunk -> digest)."""
        for part in sorted(self.unsent):
            chunks = range(part * PART_BYTES // CHUNK, min((part + 1) * PART_BYTES, self.size) // CHUNK)
            if len(chunks) * CHUNK == self._part_size(part) and all(chunk in final for chunk in chunks):
                self._send(part)

    def finish(self, final: dict[int, bytes]) -> str:
        """Send what is left, make the object whole with its checksum in its metadata; its `checksums.CHUNKED`
        checksum. ``final``: the worker's table, as `send_ready` takes it."""
        try:
            sent = [future.result() for future in self.sending]  # before the checksum: their chunks' digests taken
            checksum = file_checksum(self.path, CHUNKED, {**final, **self.sent_digests})
            metadata = {CHECKSUM_KEY: f"{CHUNKED}:{checksum}"}
            if self.created is None:
                with mmap.mmap(self.descriptor, self.size, access=mmap.ACCESS_READ) as whole:
                    self.location.write_parts(self.name, [whole], metadata)
                return checksum
            for part in sorted(self.unsent):
                self._send(part)
            sent += [future.result() for future in self.sending[len(sent) :]]
            parts = sorted(sent, key=lambda part: part["PartNumber"])
            self.sending = []
            self._wait(self._call("complete_multipart_upload", MultipartUpload={"Parts": parts}))
            source = {"Bucket": self.bucket, "Key": self.key}
            self._wait(self._call("copy_object", CopySource=source, MetadataDirective="REPLACE", Metadata=metadata))
            self.location.fs.invalidate_cache(self.location.path(self.name))
            return checksum
        except BaseException:
            self.abort()
            raise
        finally:
            self.close()

    def abort(self) -> None:
        """Stop sending and abort the upload (nothing appears); let go of the memory."""
        if self.created is not None:
            for future in self.sending:
                future.cancel()
            with contextlib.suppress(Exception):
                self._wait(self._call("abort_multipart_upload"))
            self.created = None
        self.close()

    def close(self) -> None:
        if self.descriptor >= 0:
            os.close(self.descriptor)
            self.descriptor = -1

    def _part_size(self, part: int) -> int:
        return min(PART_BYTES, self.size - part * PART_BYTES)

    def _send(self, part: int) -> None:
        self.unsent.discard(part)
        self.sending.append(self._run(self._upload_part(part)))

    async def _upload_part(self, part: int) -> dict[str, Any]:
        """Part ``part`` read from the memory file, its chunks' digests taken, sent, and its memory given back."""
        async with self.slots:
            start, size = part * PART_BYTES, self._part_size(part)
            body = self.spare.pop() if self.spare and size == PART_BYTES else bytearray(size)
            os.preadv(self.descriptor, [body], start)
            view = memoryview(body)
            for at in range(0, size, CHUNK):
                self.sent_digests[(start + at) // CHUNK] = chunk_digest(view[at : at + CHUNK])
            view.release()
            sent = await self._call("upload_part", PartNumber=part + 1, Body=body)
            if size == PART_BYTES:
                self.spare.append(body)
            _libc.fallocate(self.descriptor, _PUNCH_HOLE, ctypes.c_long(start), ctypes.c_long(size))
            return {"PartNumber": part + 1, "ETag": sent["ETag"]}

    async def _call(self, method: str, **arguments: Any) -> Any:
        """One S3 request on this shard's object (and upload, once begun)."""
        target = {"Bucket": self.bucket, "Key": self.key}
        if method != "create_multipart_upload" and method != "copy_object":
            # shielded: a part's send cancelled while it waits must not cancel the upload's creation
            target["UploadId"] = (await asyncio.shield(asyncio.wrap_future(self.created)))["UploadId"]
        return await self.location.fs._call_s3(method, **target, **arguments)

    def _run(self, coroutine: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.location.fs.loop)

    def _wait(self, coroutine: Any) -> Any:
        return self._run(coroutine).result()


__all__ = ["COPY_LIMIT", "StreamedShard"]
