"""How a harvest's shards are laid out on disk: safetensors files (the default) or SAELens's cached-activation dataset.

A layout writes one shard from per-token tensors and maps one back as per-token tensors
without copying (a private, copy-on-write mapping of the file, so the tensors can be edited
in place without touching the file). Importing this module imports neither nnsight nor vLLM.

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

import hashlib
import json
import mmap
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

FORMATS = ("safetensors", "sae-lens")
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


def _mapped(path: Path) -> mmap.mmap:
    """A private copy-on-write mapping of ``path``: edits stay in memory, the file is never written."""
    with open(path, "rb") as handle:
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` as one safetensors file at ``path``."""
    from safetensors.torch import save_file

    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path))


class Safetensors:
    """A shard is one safetensors file: ``[tokens, ...]`` per column, under our names."""

    name = "safetensors"
    patterns = ("shard-*.safetensors",)

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.manifest = manifest

    @staticmethod
    def file_name(index: int) -> str:
        return f"shard-{index:05d}.safetensors"

    def write(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        write_tensors(path, tensors)

    def columns(self, path: Path) -> dict[str, torch.Tensor]:
        """Every column of the shard at ``path``, mapped, ``[tokens, ...]``."""
        mapped = _mapped(path)
        size = int.from_bytes(mapped[:8], "little")
        header = json.loads(mapped[8 : 8 + size])
        start = 8 + size
        columns = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            first, last = entry["data_offsets"]
            count = (last - first) // torch.empty((), dtype=dtype).element_size()
            flat = (
                torch.frombuffer(mapped, dtype=dtype, count=count, offset=start + first)
                if count
                else torch.empty(0, dtype=dtype)
            )
            columns[name] = flat.reshape(entry["shape"])
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

    def write(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        from datasets.arrow_writer import ArrowWriter

        def by_row(tensor: torch.Tensor) -> Any:
            return tensor.reshape(-1, self.context, *tensor.shape[1:]).numpy()

        batch = {entry["column"]: by_row(tensors[name]) for name, entry in self.values.items()}
        batch["token_ids"] = by_row(tensors["token_ids"].to(torch.int32))
        batch["documents"] = by_row(tensors["documents"])
        batch["offsets"] = by_row(tensors["offsets"])
        writer = ArrowWriter(features=self.features(), path=str(path))
        try:
            writer.write_batch(batch)
            writer.finalize()
        finally:
            writer.close()

    def columns(self, path: Path) -> dict[str, torch.Tensor]:
        """Every column of the shard at ``path`` under our names, mapped, ``[tokens, ...]``."""
        import pyarrow as pa

        table = pa.ipc.open_stream(pa.py_buffer(_mapped(path))).read_all()

        def per_token(column: str) -> torch.Tensor:
            array = table.column(column).combine_chunks()
            array = array.storage if isinstance(array, pa.ExtensionArray) else array
            while pa.types.is_fixed_size_list(array.type) or pa.types.is_list(array.type):
                array = array.flatten()
            with warnings.catch_warnings():  # the mapping is private: writes never reach the file
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(array.to_numpy(zero_copy_only=True))

        columns = {name: per_token(entry["column"]).reshape(-1, *entry["shape"]) for name, entry in self.values.items()}
        columns["token_ids"] = per_token("token_ids").to(torch.int64)
        columns["documents"] = per_token("documents")
        columns["offsets"] = per_token("offsets")
        columns["rows"] = torch.arange(len(columns["token_ids"])) // self.context
        return columns

    def publish(self, directory: Path, records: list[dict[str, Any]]) -> None:
        """Rewrite ``state.json`` and ``dataset_info.json`` for the shards in ``records``, so that
        ``datasets.load_from_disk(directory)`` reads them, in corpus order."""
        from datasets import DatasetInfo

        from .store import write_json

        records = sorted(records, key=lambda record: record["index"])
        if not records:
            return
        info = asdict(DatasetInfo(features=self.features()))
        fingerprint = hashlib.sha256("".join(record["sha256"] for record in records).encode()).hexdigest()[:16]
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


__all__ = ["FORMATS", "METADATA", "SaeLens", "Safetensors", "layout_of", "write_tensors"]
