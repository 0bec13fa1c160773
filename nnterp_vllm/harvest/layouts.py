"""How a harvest's shards are laid out on disk: safetensors files (the default) or SAELens's cached-activation dataset.

A layout writes one shard from per-token tensors (each column in parts, as computed) and says
where in the file each column's tokens lie (`Column`: every column is stored token after token,
contiguous), so a reader can read any range of tokens straight into a tensor with one
``preadv``. Importing this module imports neither nnsight nor vLLM.

``sae-lens``: the output directory is itself a ``datasets`` ``save_to_disk`` directory that
SAELens's cached-activation training reads as it is: one row per sequence of exactly
``context_length`` tokens; per value a column named as SAELens names a transformers hook (the
module path, ``model.layers.6`` for ``layers.6.layer_output``) typed
``Array2D((context_length, d), dtype)``; ``token_ids`` as int32 sequences of that length; and
``documents``/``offsets`` (int64 sequences) for our own reader. A probe's scores are a column under their own
name (``probes.NAME``), float32: a sequence of that length for a one-score probe, else ``Array2D``. Each shard is one
``data-NNNNN.arrow`` file; ``state.json`` and ``dataset_info.json`` list the shards written
so far and are rewritten with the manifest after each one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import mmap
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checksums import CHECKSUM, HASHES, recorded_checksum
from .files import json_bytes
from .location import Location

FORMATS = ("safetensors", "sae-lens")
#: The most buffers one ``preadv`` takes (Linux's ``IOV_MAX``).
IOV_MAX = 1024
_preadv = ctypes.CDLL(None, use_errno=True).preadv
_preadv.restype = ctypes.c_ssize_t
_preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_long]
#: The key under which a shard carries its own record (its manifest record but the file's name, size and checksum,
#: and a digest of the settings it was made with): a manifest lost or damaged is rebuilt from the shards.
OWN = "nnterp_vllm"
#: Bytes at a shard's start that hold its own record (`read_own`), at most.
OWN_BYTES = 1 << 20
#: The per-token columns every shard holds besides the values.
METADATA = ("token_ids", "documents", "offsets", "rows")
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class Column:
    """Where one column of a shard lies in its file: ``tokens`` rows of ``shape``, contiguous from byte
    ``offset``; a column with no offset is computed, not stored (a sae-lens shard's ``rows``: token // context)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    tokens: int
    offset: int | None = None
    context: int | None = None

    @functools.cached_property
    def row_bytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()

    def read(self, source: Source, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` (contiguous, ``len(out)`` rows of this column's dtype) with the rows from ``start`` on."""
        if self.offset is None:
            out.copy_(torch.from_numpy(self.computed(np.arange(start, start + len(out)))))
            return
        if len(out):
            vectors = np.array([[out.data_ptr(), len(out) * self.row_bytes]], np.uint64)
            source.read_vectors(vectors, self.offset + start * self.row_bytes)

    def scatter(self, source: Source, start: int, addresses: np.ndarray) -> None:
        """Read the rows from ``start`` on, one to each address in ``addresses`` (uint64, each with room for
        a row): the source copies the file's rows straight to their places (from a local file the kernel
        does, one ``preadv`` per ``IOV_MAX`` rows). A stored column only (`computed` gives a computed one)."""
        vectors = np.empty((len(addresses), 2), np.uint64)
        vectors[:, 0], vectors[:, 1] = addresses, self.row_bytes
        source.read_vectors(vectors, self.offset + start * self.row_bytes)

    def computed(self, tokens: np.ndarray) -> np.ndarray:
        """A computed column's values at the shard's tokens ``tokens``."""
        return tokens // self.context


class Source:
    """A shard file being read: a local file's descriptor (`read_vectors` is ``preadv``); `reader` serves a
    store's through its read-through cache the same way."""

    def __init__(self, descriptor: int) -> None:
        self.descriptor = descriptor

    def read(self, offset: int, size: int) -> bytes:
        """Bytes ``offset:offset + size`` (fewer at the file's end)."""
        return os.pread(self.descriptor, size, offset)

    def prefetch(self, spans: list[tuple[int, int]]) -> None:
        """Bring the byte spans ``(offset, length)`` near before they are read: a local file needs nothing."""

    def close(self) -> None:
        """Let go of the file."""
        os.close(self.descriptor)

    def read_vectors(self, vectors: np.ndarray, offset: int) -> None:
        """Fill the buffers ``vectors`` lists (rows of uint64 address, length) with the file's bytes from
        ``offset`` on, back to back; ValueError where the file ends first."""
        position = offset
        for first in range(0, len(vectors), IOV_MAX):
            part = np.ascontiguousarray(vectors[first : first + IOV_MAX])
            got = _preadv(self.descriptor, part.ctypes.data, len(part), position)
            if got < 0:
                error = ctypes.get_errno()
                raise OSError(error, os.strerror(error))
            wanted = int(part[:, 1].sum())
            if got != wanted:
                raise ValueError(f"the file ends {wanted - got} bytes short of the rows the manifest records")
            position += wanted


#: Shard columns as computed: each column's parts (one per context row), in corpus order.
Columns = dict[str, list[torch.Tensor]]
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def joined(columns: Columns) -> dict[str, torch.Tensor]:
    """Each column as one tensor."""
    return {name: torch.cat(parts) for name, parts in columns.items()}


def safetensors_header(
    tensors: list[tuple[str, torch.dtype, list[int]]], own: dict[str, Any] | None = None
) -> tuple[bytes, int]:
    """The head of a safetensors file holding ``tensors`` (name, dtype, shape) back to back in that order (the
    header's length and the header, padded so the data starts 8-byte aligned; ``own``, the shard's own record, in
    its ``__metadata__`` under `OWN`), and the bytes of data after it."""
    header: dict[str, Any] = {} if own is None else {"__metadata__": {OWN: json.dumps(own, sort_keys=True)}}
    start = 0
    for name, dtype, shape in tensors:
        size = int(np.prod(shape)) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": shape, "data_offsets": [start, start + size]}
        start += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text, start


def _by_element_size(columns: Columns) -> list[tuple[str, torch.dtype, list[int]]]:
    """Each of ``columns`` as (name, dtype, shape), larger elements first, as safetensors orders them (every tensor
    starts aligned to its element size)."""
    order = sorted(columns, key=lambda name: -columns[name][0].element_size())
    return [
        (name, columns[name][0].dtype, [sum(len(part) for part in columns[name]), *columns[name][0].shape[1:]])
        for name in order
    ]


def _raw(part: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes, without a copy."""
    return memoryview(part.reshape(-1).view(torch.uint8).numpy())


def tensor_parts(columns: Columns, own: dict[str, Any] | None = None) -> list[Any]:
    """One safetensors file holding ``columns``, as the buffers it is written from back to back: its header (with
    ``own``), then each column's parts as computed (no joined copy)."""
    parts = {name: [part.contiguous() for part in column] for name, column in columns.items()}
    tensors = _by_element_size(parts)
    return [safetensors_header(tensors, own)[0], *(_raw(part) for name, *_ in tensors for part in parts[name])]


def parts_checksum(parts: list[Any]) -> str:
    """The checksum (`checksums.CHECKSUM`) of ``parts`` written back to back."""
    digest = HASHES[CHECKSUM]()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def read_own(head: bytes) -> dict[str, Any] | None:
    """The shard's own record (`OWN`) from the first bytes of a shard file in either layout (at least
    `OWN_BYTES`, or the whole file), or ``None`` where it carries none."""
    text = None
    if head[:4] == b"\xff\xff\xff\xff":  # an arrow stream: its schema message comes first
        import pyarrow as pa

        try:
            schema = pa.ipc.open_stream(pa.BufferReader(head)).schema
        except (pa.ArrowInvalid, OSError):
            return None
        text = (schema.metadata or {}).get(OWN.encode())
    else:
        size = int.from_bytes(head[:8], "little")
        try:
            header = json.loads(head[8 : 8 + size])
        except ValueError:
            return None
        text = (header.get("__metadata__") or {}).get(OWN) if isinstance(header, dict) else None
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


class Safetensors:
    """A shard is one safetensors file: ``[tokens, ...]`` per column, under our names."""

    name = "safetensors"
    patterns = ("shard-*.safetensors",)

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.manifest = manifest

    @staticmethod
    def file_name(index: int) -> str:
        return f"shard-{index:05d}.safetensors"

    def parts(self, columns: Columns, own: dict[str, Any]) -> list[Any]:
        """One shard's bytes, as buffers written back to back (`tensor_parts`)."""
        return tensor_parts(columns, own)

    @staticmethod
    def place(
        path: Path,
        columns: Columns,
        room: list[tuple[str, torch.dtype, list[int]]],
        own: dict[str, Any],
        reserve: bool = True,
    ) -> int:
        """Begin a shard at ``path`` whose values are filled in place: write the header, ``columns`` and then room
        for the tensors ``room`` names (name, dtype, shape; back to back, in that order, each no wider an element
        than ``columns``' narrowest; ``own``: the shard's own record), the space for it taken now where ``reserve``
        (else only the file's size set); the byte at which that room starts. Its checksum is the file's, once
        filled."""
        parts = {name: [part.contiguous() for part in column] for name, column in columns.items()}
        tensors = _by_element_size(parts)
        head, data = safetensors_header([*tensors, *room], own)
        with open(path, "wb") as handle:
            handle.write(head)
            for name, *_ in tensors:
                for part in parts[name]:
                    handle.write(_raw(part))
            start = handle.tell()
            handle.flush()
            if reserve:
                os.posix_fallocate(handle.fileno(), 0, len(head) + data)  # a full disk fails here, not mid-fill
            else:
                os.ftruncate(handle.fileno(), len(head) + data)
        return start

    def locate(self, source: Source, size: int) -> dict[str, Column]:
        """Where every column of the shard ``source`` reads lies: from the safetensors header."""
        size = int.from_bytes(source.read(0, 8), "little")
        header = json.loads(source.read(8, size))
        columns = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            shape = tuple(entry["shape"])
            first = entry["data_offsets"][0]
            columns[name] = Column(SAFETENSORS_DTYPES[entry["dtype"]], shape[1:], shape[0], 8 + size + first)
        return columns

    def publish(self, location: Location, records: list[dict[str, Any]]) -> None:
        """Nothing besides the manifest describes safetensors shards."""


class SaeLens:
    """A shard is one arrow file of a ``datasets`` directory that SAELens trains from (see the module docstring)."""

    name = "sae-lens"
    patterns = ("data-*.arrow", "state.json", "dataset_info.json")

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.manifest = manifest
        self.context = manifest["context"]["context_length"]
        self.values = manifest["values"]

    @staticmethod
    def file_name(index: int) -> str:
        return f"data-{index:05d}.arrow"

    def dtype(self, entry: dict[str, Any]) -> str:
        """The dtype a value (its manifest entry) is stored in: its own, or the harvest's."""
        return entry.get("dtype", self.manifest["dtype"])

    def features(self) -> Any:
        from datasets import Array2D, Features, Sequence, Value

        columns: dict[str, Any] = {
            entry["column"]: Array2D((self.context, *entry["shape"]), self.dtype(entry))
            if entry["shape"]
            else Sequence(Value(self.dtype(entry)), length=self.context)
            for entry in self.values.values()
        }
        columns["token_ids"] = Sequence(Value("int32"), length=self.context)
        columns["documents"] = Sequence(Value("int64"), length=self.context)
        columns["offsets"] = Sequence(Value("int64"), length=self.context)
        return Features(columns)

    def parts(self, columns: Columns, own: dict[str, Any]) -> list[Any]:
        """One shard's bytes (an arrow stream, ``own`` in its schema's metadata), as buffers written back to back."""
        import pyarrow as pa
        from datasets.arrow_writer import ArrowWriter

        class Writer(ArrowWriter):
            def _build_schema(self, inferred_schema: pa.Schema) -> tuple[pa.Schema, Any]:
                schema, features = super()._build_schema(inferred_schema)
                return schema.with_metadata({**schema.metadata, OWN: json.dumps(own, sort_keys=True)}), features

        tensors = joined(columns)

        def by_row(tensor: torch.Tensor) -> Any:
            return tensor.reshape(-1, self.context, *tensor.shape[1:]).numpy()

        batch = {entry["column"]: by_row(tensors[name]) for name, entry in self.values.items()}
        batch["token_ids"] = by_row(tensors["token_ids"].to(torch.int32))
        batch["documents"] = by_row(tensors["documents"])
        batch["offsets"] = by_row(tensors["offsets"])
        # One record batch per file, so a shard maps back as one zero-copy array per column.
        rows = len(batch["token_ids"])
        stream = pa.BufferOutputStream()
        writer = Writer(features=self.features(), stream=stream, writer_batch_size=max(rows, 1))
        try:
            writer.write_batch(batch, writer_batch_size=max(rows, 1))
            writer.finalize()
        finally:
            writer.close()
        return [stream.getvalue()]

    def locate(self, source: Source, size: int) -> dict[str, Column]:
        """Where every column of the ``size``-byte shard ``source`` reads lies, under our names: from the arrow
        stream's buffers, as laid out in a skeleton of the file (`_skeleton`: its messages' metadata read, the
        rest never touched)."""
        import pyarrow as pa

        whole = pa.py_buffer(_skeleton(source, size))
        table = pa.ipc.open_stream(pa.BufferReader(whole)).read_all()

        def column(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Column:
            chunks = table.column(name).chunks
            if len(chunks) != 1:
                raise ValueError(f"column {name!r} is in {len(chunks)} record batches; expected one")
            array = chunks[0].storage if isinstance(chunks[0], pa.ExtensionArray) else chunks[0]
            while pa.types.is_fixed_size_list(array.type) or pa.types.is_list(array.type):
                array = array.flatten()
            start = array.buffers()[1].address - whole.address + array.offset * array.type.byte_width
            per_token = int(torch.tensor(shape).prod()) if shape else 1
            return Column(dtype, shape, len(array) // per_token, start)

        columns = {
            name: column(entry["column"], getattr(torch, self.dtype(entry)), tuple(entry["shape"]))
            for name, entry in self.values.items()
        }
        columns["token_ids"] = column("token_ids", torch.int32, ())
        columns["documents"] = column("documents", torch.int64, ())
        columns["offsets"] = column("offsets", torch.int64, ())
        columns["rows"] = Column(torch.int64, (), columns["token_ids"].tokens, context=self.context)
        return columns

    def publish(self, location: Location, records: list[dict[str, Any]]) -> None:
        """Rewrite ``state.json`` and ``dataset_info.json`` for the shards in ``records``, so that
        ``datasets.load_from_disk(location)`` reads them, in corpus order."""
        from datasets import DatasetInfo

        records = sorted(records, key=lambda record: record["index"])
        if not records:
            return
        info = asdict(DatasetInfo(features=self.features()))
        checksums = "".join(record[recorded_checksum(record)] for record in records)
        fingerprint = hashlib.sha256(checksums.encode()).hexdigest()[:16]
        state = {
            "_data_files": [{"filename": record["file"]} for record in records],
            "_fingerprint": fingerprint,
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        location.write_bytes("dataset_info.json", json_bytes({key: info[key] for key in sorted(info)}, False))
        location.write_bytes("state.json", json_bytes(state))


def _skeleton(source: Source, size: int) -> mmap.mmap:
    """A ``size``-byte arrow stream's skeleton: anonymous memory as long as the file (its pages untouched, so never
    allocated) holding the file's message headers (the schema's, the record batch's) and its end marker, the
    batch's body left as zeros: enough for arrow to lay the columns out where the file holds them."""
    skeleton = mmap.mmap(-1, max(size, 1))
    position = 0
    for _ in range(2):  # the schema message, then the record batch's metadata
        head = source.read(position, 8)
        if len(head) < 8 or head[:4] != b"\xff\xff\xff\xff":
            raise ValueError("not an arrow stream of one schema and one record batch")
        length = int.from_bytes(head[4:], "little")
        skeleton[position : position + 8 + length] = head + source.read(position + 8, length)
        position += 8 + length
    skeleton[size - 8 : size] = source.read(size - 8, 8)
    return skeleton


def layout_of(manifest: dict[str, Any]) -> Safetensors | SaeLens:
    """The layout a manifest's harvest is written in."""
    return SaeLens(manifest) if manifest.get("format") == "sae-lens" else Safetensors(manifest)


__all__ = [
    "FORMATS",
    "METADATA",
    "OWN",
    "Column",
    "Columns",
    "SaeLens",
    "Safetensors",
    "Source",
    "joined",
    "layout_of",
    "parts_checksum",
    "read_own",
    "tensor_parts",
]
