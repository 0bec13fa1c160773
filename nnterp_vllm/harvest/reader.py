"""Reading a harvest back: columns, shards, a HuggingFace dataset, and shuffled batches for trainers.

Imports neither nnsight nor vLLM (nor transformers), so a trainer's environment that has
only torch (and ``datasets``/``pyarrow`` for the SAELens layout) can open a harvest.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .layouts import METADATA, layout_of
from .store import HarvestError, read_manifest, shard_problem

#: How many chunks, each from a random place of a random shard, fill one shuffle buffer.
CHUNKS_PER_BUFFER = 16


@dataclass
class Harvest:
    """A harvest on disk, read back: tokens aligned with activations, shard by shard.

    ``load_harvest(dir)`` gives one. Shards are memory-mapped (privately: editing a tensor
    read from one never changes the file), so iterating a harvest larger than memory is fine.
    """

    path: Path
    manifest: dict[str, Any]

    @property
    def values(self) -> list[str]:
        """The harvested values' names."""
        return list(self.manifest["values"])

    @property
    def records(self) -> list[dict[str, Any]]:
        """The manifest's shard records, in corpus order."""
        return sorted(self.manifest["shards"].values(), key=lambda record: record["index"])

    @property
    def shards(self) -> list[Path]:
        """The shard files, in corpus order."""
        return [self.path / record["file"] for record in self.records]

    def __len__(self) -> int:
        return sum(record["tokens"] for record in self.manifest["shards"].values())

    def _columns(self, path: Path) -> dict[str, torch.Tensor]:
        try:
            return layout_of(self.manifest).columns(path)
        except (OSError, ValueError, KeyError) as error:
            raise HarvestError(
                f"cannot read {path.name} in {self.path} ({error}); rerun the harvest command to recompute it"
            ) from error

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Each shard as ``{name: tensor}``: ``token_ids``, ``documents``, ``offsets``, ``rows`` and the values."""
        for path in self.shards:
            yield self._columns(path)

    def verify(self) -> None:
        """Check every shard's existence, size and checksum against the manifest; HarvestError naming a bad one."""
        for record in self.manifest["shards"].values():
            problem = shard_problem(self.path, record)
            if problem is not None:
                raise HarvestError(
                    f"{record['file']} in {self.path} is {problem}; rerun the harvest command to recompute it"
                )

    def load(self, name: str) -> torch.Tensor:
        """One column (a value, or ``token_ids``/``documents``/``offsets``/``rows``) for all tokens, in memory."""
        self._names([name])
        return torch.cat([shard[name] for shard in self])

    def _names(self, names: list[str]) -> list[str]:
        unknown = [name for name in names if name not in self.manifest["values"] and name not in METADATA]
        if unknown:
            raise ValueError(f"{unknown} are not in this harvest; it holds {[*self.values, *METADATA]}")
        return names

    def batches(
        self,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        values: list[str] | None = None,
        buffer_bytes: int = 256 * 2**20,
        drop_last: bool = False,
    ) -> Iterator[dict[str, torch.Tensor]]:
        """One epoch of batches ``{name: [batch_size, ...]}`` over every token of every shard, each exactly once.

        Args:
            batch_size: Tokens per batch (the last one may be shorter unless ``drop_last``).
            shuffle: A permutation of all tokens, reproducible from ``seed``; False reads in corpus order.
            seed: The permutation's seed (pass ``seed + epoch`` for a new order each epoch).
            values: The columns to yield: harvested values and ``token_ids``/``documents``/``offsets``/``rows``
                (every harvested value by default).
            buffer_bytes: The memory bound. The tokens are cut into chunks of about
                ``buffer_bytes / 16`` bytes of the chosen columns; the chunks are visited in a random
                order, 16 at a time (a buffer, from up to 16 different shards and places), and each
                buffer's tokens are dealt into batches in a random order. At most one buffer of shards
                is mapped at a time, plus the batch being built (and under one batch carried over).
            drop_last: Leave out a last batch shorter than ``batch_size``.

        Each batch is a fresh tensor per column (one copy out of the mapped shards, in either order).
        Within a batch, tokens are grouped by the chunk they were read from.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if isinstance(buffer_bytes, bool) or not isinstance(buffer_bytes, int) or buffer_bytes < 1:
            raise ValueError(f"buffer_bytes must be a positive int, got {buffer_bytes!r}")
        names = self._names(list(values) if values is not None else self.values)
        generator = torch.Generator().manual_seed(seed)
        token_bytes = sum(self._token_bytes(name) for name in names)
        chunk = max(1, buffer_bytes // CHUNKS_PER_BUFFER // max(token_bytes, 1))
        chunks = [
            (record, start, min(start + chunk, record["tokens"]))
            for record in self.records
            for start in range(0, record["tokens"], chunk)
        ]
        if shuffle:
            chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=generator).tolist()]
        carry: dict[str, torch.Tensor] | None = None
        for first in range(0, len(chunks), CHUNKS_PER_BUFFER):
            mapped: dict[Path, dict[str, torch.Tensor]] = {}
            segments = [carry] if carry else []
            for record, start, stop in chunks[first : first + CHUNKS_PER_BUFFER]:
                path = self.path / record["file"]
                if path not in mapped:
                    mapped[path] = self._columns(path)
                segments.append({name: mapped[path][name][start:stop] for name in names})
            del mapped
            lengths = torch.tensor([len(segment[names[0]]) for segment in segments])
            starts = torch.cumsum(lengths, 0) - lengths
            total = int(lengths.sum())
            order = torch.randperm(total, generator=generator) if shuffle else torch.arange(total)
            # Fewer than a batch left over lead the next buffer; after the last buffer they are the last batch.
            whole = total if first + CHUNKS_PER_BUFFER >= len(chunks) else total - total % batch_size
            for begin in range(0, whole, batch_size):
                batch = _gather(segments, names, starts, order[begin : begin + batch_size].sort().values, shuffle)
                if len(batch[names[0]]) == batch_size or not drop_last:
                    yield batch
            carry = _gather(segments, names, starts, order[whole:].sort().values, shuffle) if whole < total else None

    def _token_bytes(self, name: str) -> int:
        if name in METADATA:
            return 8
        entry = self.manifest["values"][name]
        count = 1
        for size in entry["shape"]:
            count *= size
        return count * torch.empty((), dtype=getattr(torch, self.manifest["dtype"])).element_size()

    def to_hf_dataset(self, path: Path | str | None = None) -> Any:
        """The harvest as a HuggingFace ``datasets.Dataset``, one row per token; saved to ``path`` if given.

        A harvest written with ``format="sae-lens"`` already is a dataset (one row per sequence):
        ``datasets.load_from_disk(harvest.path)`` opens it as SAELens does.
        """
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


def _gather(
    segments: list[dict[str, torch.Tensor]],
    names: list[str],
    starts: torch.Tensor,
    positions: torch.Tensor,
    shuffle: bool,
) -> dict[str, torch.Tensor]:
    """The tokens at ``positions`` (sorted) of the segments laid end to end, as new tensors."""
    owner = torch.searchsorted(starts, positions, right=True) - 1
    groups, counts = torch.unique_consecutive(owner, return_counts=True)
    batch = {}
    for name in names:
        source = segments[int(groups[0])][name]
        out = torch.empty((len(positions), *source.shape[1:]), dtype=source.dtype)
        done = 0
        for group, local in zip(groups.tolist(), torch.split(positions, counts.tolist())):
            local = local - starts[group]
            target = out[done : done + len(local)]
            if shuffle:
                torch.index_select(segments[group][name], 0, local, out=target)
            else:
                target.copy_(segments[group][name][int(local[0]) : int(local[-1]) + 1])
            done += len(local)
        batch[name] = out
    return batch


def load_harvest(path: Path | str) -> Harvest:
    """Open a harvest directory written by `harvest` (complete or not: the shards written so far)."""
    path = Path(path)
    return Harvest(path, read_manifest(path))
