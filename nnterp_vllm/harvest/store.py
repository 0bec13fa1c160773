"""The on-disk form of a harvest: sharded safetensors files and a JSON manifest, written atomically.

A directory holds ``manifest.json`` and ``shard-NNNNN.safetensors`` files. Each shard holds,
for its tokens in corpus order, ``token_ids``, ``documents`` (the document each token came
from), ``offsets`` (its position in that document), ``rows`` (the context row it was run in)
and one tensor per harvested value, ``[tokens, ...]``. A shard is written under a temporary
name and renamed; the manifest is rewritten (also by rename) after every shard, so a run
killed at any moment leaves only whole shards behind, and the next run picks up after them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MANIFEST = "manifest.json"
FORMAT = 1
#: Manifest keys that must match for a run to continue a directory.
SETTINGS = ("model", "config_hash", "engine", "dtype", "values", "positions", "context", "shard_bytes", "corpus")


class HarvestError(RuntimeError):
    """A harvest that cannot start or go on: other settings in the directory, an unwritable output."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: Path, content: dict[str, Any]) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps(content, indent=2, sort_keys=True))
    os.replace(staging, path)


class Store:
    """The output directory of one harvest: what is done, and the writing of what is next."""

    def __init__(self, out: Path | str, settings: dict[str, Any], overwrite: bool = False) -> None:
        self.out = Path(out)
        self.settings = settings
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise HarvestError(f"cannot create the output directory {self.out}: {error.strerror or error}") from error
        manifest_path = self.out / MANIFEST
        existing = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
        if existing is not None and overwrite:
            self._clear(existing)
            existing = None
        if existing is not None:
            different = [key for key in SETTINGS if existing.get(key) != settings.get(key)]
            if different:
                lines = [
                    f"  {key}: directory has {existing.get(key)!r}, this run has {settings.get(key)!r}"
                    for key in different
                ]
                raise HarvestError(
                    f"{self.out} holds a harvest made with other settings:\n"
                    + "\n".join(lines)
                    + "\nUse another --out directory, or overwrite=True (--overwrite) to replace it."
                )
        self.manifest: dict[str, Any] = existing or {"format": FORMAT, **settings, "shards": {}, "complete": False}
        for leftover in self.out.glob("*.tmp"):
            leftover.unlink()

    def _clear(self, manifest: dict[str, Any]) -> None:
        for record in manifest.get("shards", {}).values():
            (self.out / record["file"]).unlink(missing_ok=True)
        (self.out / MANIFEST).unlink()

    @property
    def done(self) -> set[int]:
        """The indices of the shards already written."""
        return {int(index) for index in self.manifest["shards"]}

    def add(self, index: int, record: dict[str, Any], stats: dict[str, Any]) -> None:
        """Record a written shard and the running totals, rewriting the manifest atomically."""
        self.manifest["shards"][str(index)] = record
        self.manifest["stats"] = stats
        self._save()

    def finish(self, stats: dict[str, Any]) -> None:
        """Mark the harvest complete."""
        self.manifest["stats"] = stats
        self.manifest["complete"] = True
        self._save()

    def _save(self) -> None:
        try:
            _write_json(self.out / MANIFEST, self.manifest)
        except OSError as error:
            (self.out / (MANIFEST + ".tmp")).unlink(missing_ok=True)
            raise HarvestError(f"cannot write the manifest in {self.out}: {error.strerror or error}") from error


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` as one safetensors file at ``path``."""
    from safetensors.torch import save_file

    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path))


def write_shard(out: Path, index: int, tensors: dict[str, torch.Tensor], record: dict[str, Any]) -> dict[str, Any]:
    """Write one shard under a temporary name, then rename it; a failed write leaves nothing behind."""
    path = Path(out) / shard_name(index)
    staging = path.with_name(path.name + ".tmp")
    try:
        write_tensors(staging, tensors)
        digest = sha256(staging)
        os.replace(staging, path)
    except OSError as error:
        staging.unlink(missing_ok=True)
        raise HarvestError(
            f"cannot write {path.name} in {out}: {error.strerror or error}. The partial file was removed; "
            "free space (or fix permissions) and rerun the same command to resume."
        ) from error
    return {**record, "file": path.name, "bytes": path.stat().st_size, "sha256": digest}


@dataclass
class Harvest:
    """A harvest on disk, read back: tokens aligned with activations, shard by shard.

    ``load_harvest(dir)`` gives one. Shards are memory-mapped, so iterating a harvest larger
    than memory is fine.
    """

    path: Path
    manifest: dict[str, Any]

    @property
    def values(self) -> list[str]:
        """The harvested values' names."""
        return list(self.manifest["values"])

    @property
    def shards(self) -> list[Path]:
        """The shard files, in corpus order."""
        records = sorted(self.manifest["shards"].values(), key=lambda record: record["index"])
        return [self.path / record["file"] for record in records]

    def __len__(self) -> int:
        return sum(record["tokens"] for record in self.manifest["shards"].values())

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Each shard as ``{name: tensor}``: ``token_ids``, ``documents``, ``offsets``, ``rows`` and the values."""
        from safetensors import safe_open

        for path in self.shards:
            with safe_open(str(path), framework="pt") as handle:
                yield {name: handle.get_tensor(name) for name in handle.keys()}

    def verify(self) -> None:
        """Check every shard against the checksum in the manifest; raise HarvestError naming a mismatch."""
        for record in self.manifest["shards"].values():
            if sha256(self.path / record["file"]) != record["sha256"]:
                raise HarvestError(f"{record['file']} in {self.path} does not match its checksum in the manifest")

    def load(self, name: str) -> torch.Tensor:
        """One column (a value, or ``token_ids``/``documents``/``offsets``/``rows``) for all tokens, in memory."""
        return torch.cat([shard[name] for shard in self])

    def to_hf_dataset(self, path: Path | str | None = None) -> Any:
        """The harvest as a HuggingFace ``datasets.Dataset``, one row per token; saved to ``path`` if given."""
        import datasets

        def generate() -> Iterator[dict[str, Any]]:
            for shard in self:
                columns = {
                    name: tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()
                    for name, tensor in shard.items()
                }
                for i in range(len(columns["token_ids"])):
                    yield {name: column[i] for name, column in columns.items()}

        dataset = datasets.Dataset.from_generator(generate)
        if path is not None:
            dataset.save_to_disk(str(path))
        return dataset


def load_harvest(path: Path | str) -> Harvest:
    """Open a harvest directory written by `harvest` (complete or not: the shards written so far)."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise HarvestError(f"{path} holds no harvest: {MANIFEST} is missing")
    return Harvest(path, json.loads(manifest_path.read_text()))
