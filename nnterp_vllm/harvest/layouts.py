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
``documents``/``offsets`` (int64 sequences) for our own reader. Each shard is one
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

from .checksums import CHECKSUM, HASHES, file_checksum, recorded_checksum
from .files import write_json

FORMATS = ("safetensors", "sae-lens")
#: The most buffers one ``preadv`` takes (Linux's ``IOV_MAX``).
IOV_MAX = 1024
_preadv = ctypes.CDLL(None, use_errno=True).preadv
_preadv.restype = ctypes.c_ssize_t
_preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_long]
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

    def read(self, descriptor: int, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` (contiguous, ``len(out)`` rows of this column's dtype) with the rows from ``start`` on."""
        if self.offset is None:
            out.copy_(torch.from_numpy(self.computed(np.arange(start, start + len(out)))))
            return
        if not len(out):
            return
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        wanted = len(out) * self.row_bytes
        got = os.preadv(descriptor, [view], self.offset + start * self.row_bytes)
        self._check(wanted, got)

    def scatter(self, descriptor: int, start: int, addresses: np.ndarray) -> None:
        """Read the rows from ``start`` on, one to each address in ``addresses`` (uint64, each with room for
        a row), in one ``preadv`` per ``IOV_MAX`` rows: the kernel copies the file's rows straight to their
        places. A stored column only (`computed` gives a computed one)."""
        vectors = np.empty((len(addresses), 2), np.uint64)
        vectors[:, 0], vectors[:, 1] = addresses, self.row_bytes
        for first in range(0, len(vectors), IOV_MAX):
            part = vectors[first : first + IOV_MAX]
            got = _preadv(descriptor, part.ctypes.data, len(part), self.offset + (start + first) * self.row_bytes)
            if got < 0:
                error = ctypes.get_errno()
                raise OSError(error, os.strerror(error))
            self._check(len(part) * self.row_bytes, got)

    def computed(self, tokens: np.ndarray) -> np.ndarray:
        """A computed column's values at the shard's tokens ``tokens``."""
        return tokens // self.context

    @staticmethod
    def _check(wanted: int, got: int) -> None:
        if got != wanted:
            raise ValueError(f"the file ends {wanted - got} bytes short of the rows the manifest records")


#: Shard columns as computed: each column's parts (one per context row), in corpus order.
Columns = dict[str, list[torch.Tensor]]
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def joined(columns: Columns) -> dict[str, torch.Tensor]:
    """Each column as one tensor."""
    return {name: torch.cat(parts) for name, parts in columns.items()}


def safetensors_header(tensors: list[tuple[str, torch.dtype, list[int]]]) -> tuple[bytes, int]:
    """The head of a safetensors file holding ``tensors`` (name, dtype, shape) back to back in that order (the
    header's length and the header, padded so the data starts 8-byte aligned), and the bytes of data after it."""
    header: dict[str, Any] = {}
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


def write_tensors(path: Path, columns: Columns) -> str:
    """Write ``columns`` as one safetensors file at ``path``, straight from their parts (no joined copy);
    its checksum (`checksums.CHECKSUM`), computed from the bytes as they are written."""
    parts = {name: [part.contiguous() for part in column] for name, column in columns.items()}
    tensors = _by_element_size(parts)
    buffers = [safetensors_header(tensors)[0]]
    buffers += [memoryview(part.reshape(-1).view(torch.uint8).numpy()) for name, *_ in tensors for part in parts[name]]
    digest = HASHES[CHECKSUM]()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for buffer in buffers:
            digest.update(buffer)
            while len(buffer):
                buffer = buffer[os.write(descriptor, buffer) :]
    finally:
        os.close(descriptor)
    return digest.hexdigest()


class Safetensors:
    """A shard is one safetensors file: ``[tokens, ...]`` per column, under our names."""

    name = "safetensors"
    patterns = ("shard-*.safetensors",)

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.manifest = manifest

    @staticmethod
    def file_name(index: int) -> str:
        return f"shard-{index:05d}.safetensors"

    def write(self, path: Path, columns: Columns) -> str:
        """Write one shard at ``path``; its checksum."""
        return write_tensors(path, columns)

    @staticmethod
    def place(path: Path, columns: Columns, room: list[tuple[str, torch.dtype, list[int]]]) -> int:
        """Begin a shard at ``path`` whose values are filled in place: write the header, ``columns`` and then room
        for the tensors ``room`` names (name, dtype, shape; back to back, in that order, each no wider an element
        than ``columns``' narrowest); the byte at which that room starts. Its checksum is the file's, once filled."""
        parts = {name: [part.contiguous() for part in column] for name, column in columns.items()}
        tensors = _by_element_size(parts)
        head, data = safetensors_header([*tensors, *room])
        with open(path, "wb") as handle:
            handle.write(head)
            for name, *_ in tensors:
                for part in parts[name]:
                    handle.write(memoryview(part.reshape(-1).view(torch.uint8).numpy()))
            start = handle.tell()
            handle.flush()
            os.posix_fallocate(handle.fileno(), 0, len(head) + data)  # a full disk fails here, not mid-fill
        return start

    def locate(self, path: Path) -> dict[str, Column]:
        """Where every column of the shard at ``path`` lies: from the safetensors header."""
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        columns = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            shape = tuple(entry["shape"])
            first = entry["data_offsets"][0]
            columns[name] = Column(SAFETENSORS_DTYPES[entry["dtype"]], shape[1:], shape[0], 8 + size + first)
        return columns

    def publish(self, directory: Path, records: list[dict[str, Any]]) -> None:
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

    def features(self) -> Any:
        from datasets import Array2D, Features, Sequence, Value

        columns: dict[str, Any] = {
            entry["column"]: Array2D((self.context, *entry["shape"]), self.manifest["dtype"])
            for entry in self.values.values()
        }
        columns["token_ids"] = Sequence(Value("int32"), length=self.context)
        columns["documents"] = Sequence(Value("int64"), length=self.context)
        columns["offsets"] = Sequence(Value("int64"), length=self.context)
        return Features(columns)

    def write(self, path: Path, columns: Columns) -> str:
        """Write one shard at ``path``; its checksum."""
        from datasets.arrow_writer import ArrowWriter

        tensors = joined(columns)

        def by_row(tensor: torch.Tensor) -> Any:
            return tensor.reshape(-1, self.context, *tensor.shape[1:]).numpy()

        batch = {entry["column"]: by_row(tensors[name]) for name, entry in self.values.items()}
        batch["token_ids"] = by_row(tensors["token_ids"].to(torch.int32))
        batch["documents"] = by_row(tensors["documents"])
        batch["offsets"] = by_row(tensors["offsets"])
        # One record batch per file, so a shard maps back as one zero-copy array per column.
        rows = len(batch["token_ids"])
        writer = ArrowWriter(features=self.features(), path=str(path), writer_batch_size=max(rows, 1))
        try:
            writer.write_batch(batch, writer_batch_size=max(rows, 1))
            writer.finalize()
        finally:
            writer.close()
        return file_checksum(path)

    def locate(self, path: Path) -> dict[str, Column]:
        """Where every column of the shard at ``path`` lies, under our names: from the arrow stream's buffers."""
        import pyarrow as pa

        with open(path, "rb") as handle:
            whole = pa.py_buffer(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
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

        dtype = getattr(torch, self.manifest["dtype"])
        columns = {name: column(entry["column"], dtype, tuple(entry["shape"])) for name, entry in self.values.items()}
        columns["token_ids"] = column("token_ids", torch.int32, ())
        columns["documents"] = column("documents", torch.int64, ())
        columns["offsets"] = column("offsets", torch.int64, ())
        columns["rows"] = Column(torch.int64, (), columns["token_ids"].tokens, context=self.context)
        return columns

    def publish(self, directory: Path, records: list[dict[str, Any]]) -> None:
        """Rewrite ``state.json`` and ``dataset_info.json`` for the shards in ``records``, so that
        ``datasets.load_from_disk(directory)`` reads them, in corpus order."""
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
        write_json(directory / "dataset_info.json", {key: info[key] for key in sorted(info)}, sort_keys=False)
        write_json(directory / "state.json", state)


def layout_of(manifest: dict[str, Any]) -> Safetensors | SaeLens:
    """The layout a manifest's harvest is written in."""
    return SaeLens(manifest) if manifest.get("format") == "sae-lens" else Safetensors(manifest)


__all__ = ["FORMATS", "METADATA", "Column", "Columns", "SaeLens", "Safetensors", "joined", "layout_of", "write_tensors"]
