"""Reading a harvest back: columns, shards, a HuggingFace dataset, and shuffled batches for trainers.

A harvest is read where it lies: a local directory, or any fsspec URL (``s3://...``), whose shards are read as
byte ranges through a local read-through cache bounded in bytes (`cache`), never downloaded whole unless asked
(`Harvest.download`). Imports neither nnsight nor vLLM (nor transformers), so a trainer's environment that has
only torch (and ``datasets``/``pyarrow`` for the SAELens layout, fsspec and the store's file system for a URL) can
open a harvest.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .cache import CACHE_BYTES, BlockCache
from .layouts import METADATA, Column, Source, layout_of
from .location import Location
from .store import MANIFEST, HarvestError, positive_int, read_manifest, shard_problem

#: How many chunks, each from a random place of a random shard, make one shuffle window.
CHUNKS_PER_WINDOW = 16


@dataclass
class Harvest:
    """A harvest on disk or on a store, read back: tokens aligned with activations, shard by shard.

    ``load_harvest(dir_or_url)`` gives one. Reading takes the tokens a call asks for straight from the
    files (one ``preadv`` per column and range; on a store, from the blocks of the read-through cache), so a
    harvest larger than memory (or than the cache) is fine.
    """

    path: Path | str
    manifest: dict[str, Any]
    location: Location | None = None
    #: The read-through cache of a harvest on a store.
    cache: BlockCache | None = None
    #: A shuffled read's batch buffers, kept for the next window or epoch (see `batches`).
    _buffers: _Buffers = field(default_factory=lambda: _Buffers(), repr=False, compare=False)

    @property
    def values(self) -> list[str]:
        """The harvested values' names."""
        return list(self.manifest["values"])

    @property
    def records(self) -> list[dict[str, Any]]:
        """The manifest's shard records, in corpus order."""
        return sorted(self.manifest["shards"].values(), key=lambda record: record["index"])

    def __post_init__(self) -> None:
        if self.location is None:
            self.location = Location.of(self.path)

    @property
    def shards(self) -> list[Path] | list[str]:
        """The shard files, in corpus order (on a store, their URLs)."""
        if self.location.local is None:
            return [f"{self.location.url.rstrip('/')}/{record['file']}" for record in self.records]
        return [self.location.local / record["file"] for record in self.records]

    def __len__(self) -> int:
        return sum(record["tokens"] for record in self.manifest["shards"].values())

    def _located(self, record: dict[str, Any]) -> dict[str, Column]:
        try:
            with self._open(record) as source:
                columns = layout_of(self.manifest).locate(source, record["bytes"])
        except (OSError, ValueError, KeyError) as error:
            raise self._unreadable(record, error) from error
        if columns["token_ids"].tokens != record["tokens"]:
            raise self._unreadable(record, f"it holds {columns['token_ids'].tokens} tokens, not {record['tokens']}")
        return columns

    def _unreadable(self, record: dict[str, Any], why: Any) -> HarvestError:
        return HarvestError(
            f"cannot read {record['file']} in {self.path} ({why}); rerun the harvest command to recompute it"
        )

    def _read(
        self,
        record: dict[str, Any],
        columns: dict[str, Column],
        names: list[str],
        start: int,
        stop: int,
        out: dict[str, torch.Tensor],
        at: int,
    ) -> None:
        """Read tokens ``start:stop`` of ``names`` from one shard into ``out[name][at:]``."""
        with self._open(record) as source:
            spans = [_span(columns[name], start, stop) for name in names]
            source.prefetch([span for span in spans if span is not None])
            for name in names:
                columns[name].read(source, start, out[name][at : at + stop - start])

    @staticmethod
    def _empty(columns: dict[str, Column], names: list[str], count: int) -> dict[str, torch.Tensor]:
        return {name: torch.empty((count, *columns[name].shape), dtype=columns[name].dtype) for name in names}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Each shard as ``{name: tensor}``: ``token_ids``, ``documents``, ``offsets``, ``rows`` and the values."""
        names = [*METADATA, *self.values]
        for record in self.records:
            columns = self._located(record)
            shard = self._empty(columns, names, record["tokens"])
            self._read(record, columns, names, 0, record["tokens"], shard, 0)
            yield _as_read(shard)

    def verify(self) -> None:
        """Check every shard's existence, size and checksum against the manifest (on a store: one HEAD each, its
        size and the checksum its metadata carries); HarvestError naming a bad one."""
        for record in self.manifest["shards"].values():
            problem = shard_problem(self.location, record)
            if problem is not None:
                raise HarvestError(
                    f"{record['file']} in {self.path} is {problem}; rerun the harvest command to recompute it"
                )

    def load(self, name: str) -> torch.Tensor:
        """One column (a value, or ``token_ids``/``documents``/``offsets``/``rows``) for all tokens, in memory."""
        self._names([name])
        records = self.records
        if not records:
            return torch.empty(0)
        columns = [self._located(record) for record in records]
        out = self._empty(columns[0], [name], len(self))
        at = 0
        for record, located in zip(records, columns):
            self._read(record, located, [name], 0, record["tokens"], out, at)
            at += record["tokens"]
        return _as_read(out)[name]

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
            buffer_bytes: The memory bound of a shuffled read. A window holds as many whole batches of the
                chosen columns as fit in ``buffer_bytes`` (at least one); the tokens are cut into chunks of a
                16th of a window, the chunks are taken in a random order, about 16 to a window (so a window
                mixes up to 16 places of up to 16 shards), and each window's tokens are dealt into batches
                in a random order. Memory: a window's batches, all read before the first is yielded (at most
                ``buffer_bytes``, or one batch), plus the batches the caller still holds; the files are read,
                never mapped, each chunk in one run. A sequential read holds one batch.
            drop_last: Leave out a last batch shorter than ``batch_size``.

        Every batch is copied once from the files: a sequential batch is one tensor per column, read in
        one ``preadv`` each; a shuffled batch's columns are views of one buffer, each token's rows read
        by the kernel straight from the file into its slot. A shuffled batch's buffer is reused for a
        later batch (this epoch's, or the next's: the harvest keeps the last window's buffers, at most
        ``buffer_bytes``) only once no tensor over it is left, so holding (or keeping a view of) a batch is safe.
        """
        positive_int(batch_size, "batch_size")
        positive_int(buffer_bytes, "buffer_bytes")
        names = self._names(list(values) if values is not None else self.values)
        records = [record for record in self.records if record["tokens"]]
        if not records:
            return
        located = {record["index"]: self._located(record) for record in records}
        sample = located[records[0]["index"]]
        token_bytes = max(1, sum(sample[name].row_bytes for name in names))
        # A window holds a whole number of batches, so no batch straddles two; its chunks are a 16th of it.
        capacity = max(batch_size, buffer_bytes // token_bytes // batch_size * batch_size) if shuffle else batch_size
        chunk = max(1, capacity // CHUNKS_PER_WINDOW) if shuffle else batch_size
        chunks = [
            (record, start, min(start + chunk, record["tokens"]))
            for record in records
            for start in range(0, record["tokens"], chunk)
        ]
        if not shuffle:  # each batch read straight from the files into its own tensors
            for pieces in _windows(chunks, batch_size):
                count = sum(stop - start for _, start, stop in pieces)
                if count == batch_size or not drop_last:
                    yield self._gathered(pieces, located, names, count)
            return
        generator = torch.Generator().manual_seed(seed)
        chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=generator).tolist()]
        scatter = _Scatter(self, located, names)
        try:
            for window in _windows(chunks, capacity):
                starts = np.cumsum([0, *(stop - start for _, start, stop in window)])
                order = torch.randperm(int(starts[-1]), generator=generator).numpy()
                batches = scatter.window(window, starts, order, batch_size)
                if drop_last and len(order) % batch_size:
                    batches.pop()  # the epoch's last batch, short
                batches.reverse()
                while batches:  # nothing here keeps a batch once it is yielded
                    yield _as_read(batches.pop())
        finally:
            scatter.close()

    @contextlib.contextmanager
    def _open(self, record: dict[str, Any]) -> Iterator[Source]:
        """A reader of the shard ``record`` names; a failed read in it is a HarvestError naming the shard."""
        source = self._source(record)
        try:
            yield source
        except (OSError, ValueError) as error:
            raise self._unreadable(record, error) from error
        finally:
            source.close()

    def _source(self, record: dict[str, Any]) -> Source:
        """A reader of the shard ``record`` names: its local file, or its object through the read-through cache."""
        if self.location.local is None:
            if self.cache is None:
                self.cache = BlockCache()
            return self.cache.source(self.location, record)
        try:
            return Source(os.open(self.location.local / record["file"], os.O_RDONLY))
        except OSError as error:
            raise self._unreadable(record, error) from error

    def download(self, directory: Path | str) -> Harvest:
        """Copy this harvest (every shard whole, and what describes them) into the local ``directory``, each shard
        checked against its checksum; the copy, opened. For a reader that needs a local directory (SAELens's
        ``cached_activations_path``)."""
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        names = [record["file"] for record in self.records] + [
            name for name in ("state.json", "dataset_info.json") if self.location.exists(name)
        ]
        for name in names:
            if self.location.local is not None:
                (target / name).write_bytes((self.location.local / name).read_bytes())
            else:
                self.location.download(name, target / name)
        (target / MANIFEST).write_bytes(self.location.read_bytes(MANIFEST))
        copy = load_harvest(target)
        copy.verify()
        return copy

    def _gathered(self, pieces: list, located: dict, names: list[str], count: int) -> dict[str, torch.Tensor]:
        batch = self._empty(located[pieces[0][0]["index"]], names, count)
        at = 0
        for record, start, stop in pieces:
            self._read(record, located[record["index"]], names, start, stop, batch, at)
            at += stop - start
        return _as_read(batch)

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


def _windows(chunks: list, capacity: int) -> Iterator[list[tuple[dict[str, Any], int, int]]]:
    """The chunks, in their order, grouped into windows (or batches) of ``capacity`` tokens (the last may hold
    fewer); a chunk that does not fit is cut where its window ends, its rest starting the next one."""
    window: list[tuple[dict[str, Any], int, int]] = []
    total = 0
    for record, start, stop in chunks:
        while start < stop:
            take = min(stop - start, capacity - total)
            window.append((record, start, start + take))
            total, start = total + take, start + take
            if total == capacity:
                yield window
                window, total = [], 0
    if window:
        yield window


class _Scatter:
    """A shuffled epoch's reads. A window's batches are built at once: the kernel reads each chunk's rows,
    in file order, straight from the shard into each token's slot in its batch (one ``preadv`` per chunk
    and column, `Column.scatter`); no shard is mapped. A batch's columns lie in one buffer, reused once
    the caller holds no tensor over it (so a new batch is written to pages already in memory)."""

    def __init__(self, harvest: Harvest, located: dict[int, dict[str, Column]], names: list[str]) -> None:
        self.harvest = harvest
        self.located = located
        self.names = names
        self.sources: dict[int, Source] = {}

    def window(self, window: list, starts: np.ndarray, order: np.ndarray, batch_size: int) -> list[dict]:
        """The window's batches: batch ``b`` holds its tokens at positions ``order[b * batch_size :][:batch_size]``
        (``starts``: where each piece of the window begins), in window order."""
        first = self.located[window[0][0]["index"]]
        slots = np.empty(len(order), np.uint64)  # each window position's place in the batches: batch * size + slot
        picks = [np.sort(order[begin : begin + batch_size]) for begin in range(0, len(order), batch_size)]
        for number, picked in enumerate(picks):
            slots[picked] = np.arange(number * batch_size, number * batch_size + len(picked))
        sizes = [[-(-len(picked) * first[name].row_bytes // 64) * 64 for name in self.names] for picked in picks]
        buffers = self.harvest._buffers.take([sum(size) for size in sizes])
        batches = [self.batch(first, len(picked), buffer, size) for picked, buffer, size in zip(picks, buffers, sizes)]
        del buffers
        tokens = np.concatenate([np.arange(start, stop) for _, start, stop in window])  # each position's, in its shard
        which, slot = np.divmod(slots, np.uint64(batch_size))
        spans: dict[int, list[tuple[int, int]]] = {}
        for record, start, stop in window:  # a store's blocks of the whole window, fetched at once per shard
            located = self.located[record["index"]]
            spans.setdefault(record["index"], []).extend(
                span for name in self.names if (span := _span(located[name], start, stop)) is not None
            )
        for record, _, _ in window:
            if record["index"] in spans:
                self.source(record).prefetch(spans.pop(record["index"]))
        for name in self.names:
            if first[name].offset is None:
                for batch, picked in zip(batches, picks):
                    batch[name].copy_(torch.from_numpy(first[name].computed(tokens[picked])))
                continue
            bases = np.array([batch[name].data_ptr() for batch in batches], np.uint64)
            addresses = bases[which] + slot * np.uint64(first[name].row_bytes)
            for j, (record, start, _) in enumerate(window):
                column = self.located[record["index"]][name]
                try:
                    column.scatter(self.source(record), start, addresses[starts[j] : starts[j + 1]])
                except (OSError, ValueError) as error:
                    raise self.harvest._unreadable(record, error) from error
        return batches

    def batch(self, first: dict[str, Column], count: int, buffer: np.ndarray, sizes: list[int]) -> dict:
        """An unfilled batch of ``count`` tokens: each column a view of ``buffer``, ``sizes`` bytes apart."""
        batch, at = {}, 0
        for name, size in zip(self.names, sizes):
            column = first[name]
            raw = torch.frombuffer(buffer, dtype=torch.uint8, count=count * column.row_bytes, offset=at)
            batch[name] = raw.view(column.dtype).view(count, *column.shape)
            at += size
        return batch

    def source(self, record: dict[str, Any]) -> Source:
        if record["index"] not in self.sources:
            self.sources[record["index"]] = self.harvest._source(record)
        return self.sources[record["index"]]

    def close(self) -> None:
        for source in self.sources.values():
            source.close()
        self.sources.clear()


class _Buffers:
    """A harvest's batch buffers for shuffled reads, each reused once no tensor over it is left (a tensor made
    by ``torch.frombuffer`` holds its buffer): the latest window's, and the window's before it that the
    caller still held when the latest was taken (its current batch, likely let go soon; dropped if still
    held a window later). What this keeps beyond what the caller holds is at most one window."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # two threads reading one harvest never take the same buffer
        self.latest: list[np.ndarray] = []
        self.held: list[np.ndarray] = []

    def take(self, sizes: list[int]) -> list[np.ndarray]:
        """Buffers of ``sizes`` bytes for a new window, none with a tensor over it."""
        with self.lock:
            latest = [_unheld(self.latest, i) for i in range(len(self.latest))]
            held = [_unheld(self.held, i) for i in range(len(self.held))]
            spare = [buffer for buffer, free in zip([*self.latest, *self.held], latest + held) if free]
            self.held = [buffer for buffer, free in zip(self.latest, latest) if not free]
            self.latest = []
            for size in sizes:
                fits = [i for i in range(len(spare)) if spare[i].nbytes == size]
                self.latest.append(spare.pop(fits[0]) if fits else self.allocate(size))
            return list(self.latest)

    @staticmethod
    def allocate(size: int) -> np.ndarray:
        return np.empty(size, np.uint8)


def _unheld(buffers: list[np.ndarray], i: int) -> bool:
    """Whether nothing but the list (and this call's argument) refers to ``buffers[i]``."""
    return sys.getrefcount(buffers[i]) == 2


def _as_read(columns: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Metadata columns as int64, whatever a layout stores them as (sae-lens keeps token ids in int32)."""
    return {name: tensor.long() if name in METADATA else tensor for name, tensor in columns.items()}


def _span(column: Column, start: int, stop: int) -> tuple[int, int] | None:
    """The bytes a stored column's tokens ``start:stop`` lie in: ``(offset, length)``; None for a computed one."""
    if column.offset is None:
        return None
    return column.offset + start * column.row_bytes, (stop - start) * column.row_bytes


def load_harvest(
    path: Path | str,
    *,
    storage_options: dict[str, Any] | None = None,
    cache_dir: Path | str | None = None,
    cache_bytes: int = CACHE_BYTES,
) -> Harvest:
    """Open a harvest written by `harvest` (complete or not: the shards written so far): a local directory, or any
    fsspec URL (``s3://bucket/run``; credentials and endpoint from the store's usual environment, or
    ``storage_options``), whose shards are read as byte ranges through a read-through cache in ``cache_dir``
    (``$XDG_CACHE_HOME/nnterp_vllm/harvest-blocks`` by default) of at most ``cache_bytes`` bytes."""
    location = Location.of(path, storage_options)
    positive_int(cache_bytes, "cache_bytes")
    cache = None if location.local is not None else BlockCache(cache_dir, cache_bytes)
    where = location.local if location.local is not None else location.url
    return Harvest(where, read_manifest(location), location, cache)
