"""`harvest`: a corpus through a model to activations on disk, streaming, resumable, on either engine.

The corpus becomes context rows (`corpus`), the rows become shards of about
``shard_bytes`` each, cut at row boundaries in corpus order: the plan depends on the
corpus and the settings only, so a rerun, a resumed run and a run fanned out over Ray
workers write the same shards. A shard is computed in batches (rows sorted by length on
transformers, one invoke per row on vLLM) and written atomically, then recorded in the
manifest.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nnsight
import torch

from .corpus import ContextSettings, CorpusError, CorpusStats, Row, read_documents, rows
from .selection import Selection, parse, token_shape
from .store import Harvest, HarvestError, Store, load_harvest, write_shard

ENGINES = ("transformers", "vllm")
Positions = str | Callable[[list[int]], list[bool]]


@dataclass
class Unit:
    """One shard's worth of rows: the unit of work, of writing and of resuming."""

    index: int
    rows: list[Row] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(row.token_ids) for row in self.rows)


@dataclass(frozen=True)
class Job:
    """Everything a worker needs to compute and write a shard, without the model."""

    out: str
    selections: tuple[Selection, ...]
    positions: Any
    context_length: int | None
    dtype: str
    batch_size: int


def load_model(model: Any, engine: str, model_kwargs: dict[str, Any] | None = None, dispatch: bool = True) -> Any:
    """A standardized model: ``model`` itself, or built from a checkpoint on ``engine``."""
    engine = "transformers" if engine == "hf" else engine
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")
    if not isinstance(model, (str, Path)):
        return model
    kwargs = dict(model_kwargs or {})
    if engine == "vllm":
        from ..engines.vllm import StandardizedVLLM

        kwargs.setdefault("max_model_len", 2048)
        return StandardizedVLLM(model, dispatch=dispatch, **kwargs)
    from ..engines.transformers import StandardizedTransformer

    return StandardizedTransformer(model, dispatch=dispatch, **kwargs)


def plan(row_stream: Iterator[Row], tokens_per_shard: int) -> Iterator[Unit]:
    """Cut rows, in corpus order, into units of at least ``tokens_per_shard`` tokens (the last one short)."""
    unit = Unit(0)
    for row in row_stream:
        unit.rows.append(row)
        if unit.tokens >= tokens_per_shard:
            yield unit
            unit = Unit(unit.index + 1)
    if unit.rows:
        yield unit


def _kept(row: Row, positions: Any) -> slice | torch.Tensor:
    count = len(row.token_ids)
    if positions == "all":
        return slice(None)
    if positions == "last":
        return slice(count - 1, count)
    mask = torch.as_tensor(positions(list(row.token_ids)), dtype=torch.bool)
    if mask.shape != (count,):
        raise ValueError(f"the positions mask has shape {tuple(mask.shape)}; expected one flag per token, ({count},)")
    return mask


def compute(model: Any, unit: Unit, job: Job) -> dict[str, torch.Tensor]:
    """The shard's tensors: metadata and every selected value, ``[kept tokens, ...]``, in corpus order."""
    per_row = _run_vllm(model, unit.rows, job) if model.ENGINE == "vllm" else _run_transformers(model, unit.rows, job)
    dtype = getattr(torch, job.dtype)
    columns: dict[str, list[torch.Tensor]] = {name: [] for name in ("token_ids", "documents", "offsets", "rows")}
    columns.update({selection.name: [] for selection in job.selections})
    for number, (row, values) in enumerate(zip(unit.rows, per_row)):
        kept = _kept(row, job.positions)
        columns["token_ids"].append(torch.tensor(row.token_ids, dtype=torch.int64)[kept])
        columns["documents"].append(torch.tensor(row.documents, dtype=torch.int64)[kept])
        columns["offsets"].append(torch.tensor(row.offsets, dtype=torch.int64)[kept])
        columns["rows"].append(torch.full(columns["token_ids"][-1].shape, number, dtype=torch.int64))
        for selection in job.selections:
            value = values[selection.name][kept]
            # Expert indices stay integers; activations are stored in the harvest's dtype.
            columns[selection.name].append(value.to(dtype) if value.is_floating_point() else value)
    return {name: torch.cat(parts) for name, parts in columns.items()}


def batches(unit_rows: list[Row], batch_size: int, pad: int) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Rows sorted by length (little padding) in batches: ``(row numbers, input_ids, attention_mask)``, right-padded."""
    order = sorted(range(len(unit_rows)), key=lambda i: -len(unit_rows[i].token_ids))
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        lengths = [len(unit_rows[i].token_ids) for i in batch]
        ids = torch.full((len(batch), max(lengths)), pad, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for slot, i in enumerate(batch):
            ids[slot, : lengths[slot]] = torch.tensor(unit_rows[i].token_ids)
            mask[slot, : lengths[slot]] = 1
        yield batch, ids, mask


def _run_transformers(model: Any, unit_rows: list[Row], job: Job) -> list[dict[str, torch.Tensor]]:
    """Values per row, in row order, computed in `batches`."""
    results: list[dict[str, torch.Tensor]] = [{} for _ in unit_rows]
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
    for batch, ids, mask in batches(unit_rows, job.batch_size, pad):
        with torch.no_grad(), model.trace({"input_ids": ids, "attention_mask": mask}):
            saved = nnsight.save({})
            for selection in job.selections:
                saved[selection.name] = selection.read(model)
        for slot, i in enumerate(batch):
            length = len(unit_rows[i].token_ids)
            results[i] = {
                selection.name: selection.per_token(saved[selection.name][slot : slot + 1], length, job.context_length)
                for selection in job.selections
            }
    return results


def _run_vllm(model: Any, unit_rows: list[Row], job: Job) -> list[dict[str, torch.Tensor]]:
    """One invoke per row, all in one engine call; values per row, in row order."""
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        saved = nnsight.save({})
        for number, row in enumerate(unit_rows):
            with tracer.invoke(list(row.token_ids)):
                for selection in job.selections:
                    saved[(number, selection.name)] = selection.read(model)
    return [
        {
            selection.name: selection.per_token(saved[(number, selection.name)], len(row.token_ids), job.context_length)
            for selection in job.selections
        }
        for number, row in enumerate(unit_rows)
    ]


def shard_record(unit: Unit, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What the manifest says of a shard besides its file and checksum."""
    documents = [document for row in unit.rows for document in row.documents]
    return {
        "index": unit.index,
        "rows": len(unit.rows),
        "row_tokens": unit.tokens,
        "tokens": int(tensors["token_ids"].shape[0]),
        "first_document": min(documents),
        "last_document": max(documents),
    }


def run_unit(model: Any, unit: Unit, job: Job) -> dict[str, Any]:
    """Compute and write one shard; its manifest record."""
    tensors = compute(model, unit, job)
    return write_shard(Path(job.out), unit.index, tensors, shard_record(unit, tensors))


class Progress:
    """A progress bar with documents, tokens and tokens/s, and the closing summary line."""

    def __init__(self, enabled: bool, stats: CorpusStats) -> None:
        from tqdm.auto import tqdm

        self.stats = stats
        self.start = time.perf_counter()
        self.tokens = 0
        self.shards = 0
        self.bar = tqdm(unit=" tok", unit_scale=True, disable=not enabled, desc="harvest")

    def shard_done(self, tokens: int) -> None:
        self.tokens += tokens
        self.shards += 1
        self.bar.update(tokens)
        self.bar.set_postfix(documents=self.stats.documents, shards=self.shards, refresh=False)

    def summary(self, out: Path) -> str:
        self.bar.close()
        seconds = max(time.perf_counter() - self.start, 1e-9)
        return (
            f"harvested {self.tokens} tokens in {self.shards} new shards from {self.stats.documents} documents "
            f"({self.stats.empty} empty skipped, {self.stats.truncated} truncated, {self.stats.split} split) "
            f"at {self.tokens / seconds:.1f} tokens/s into {out}"
        )


def _fingerprint(corpus: Any) -> str:
    """What identifies the corpus for a resumed run: a path and its size, or a digest of an in-memory corpus."""
    if isinstance(corpus, (str, Path)):
        path = Path(corpus)
        if not path.exists():
            raise CorpusError(f"cannot read the corpus {path}: no such file or directory")
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
        return f"{path.resolve()} ({size} bytes)"
    fingerprint = getattr(corpus, "_fingerprint", None)
    if fingerprint is not None:
        return f"datasets.Dataset {fingerprint}"
    digest = hashlib.sha256(json.dumps(list(corpus), sort_keys=True).encode()).hexdigest()[:16]
    return f"in-memory corpus {digest}"


def harvest(
    model: Any,
    corpus: Any,
    values: list[str] | str,
    out: Path | str,
    *,
    engine: str = "transformers",
    positions: Positions = "all",
    context_length: int | None = None,
    overflow: str = "truncate",
    add_bos: bool = True,
    text_field: str = "text",
    batch_size: int = 8,
    shard_bytes: int = 256 * 2**20,
    dtype: str | None = None,
    overwrite: bool = False,
    workers: int = 1,
    ray_address: str | None = None,
    model_kwargs: dict[str, Any] | None = None,
    progress: bool = True,
) -> Harvest:
    """Harvest ``values`` of ``model`` over ``corpus`` into ``out``; return the harvest, opened.

    Args:
        model: A checkpoint directory (or hub id), or a StandardizedTransformer / StandardizedVLLM.
        corpus: A .txt file (a document per line), a directory of .txt files, a .jsonl file, a
            ``datasets`` dataset (object or saved directory), or a list of texts or of token-id lists.
        values: Selectors such as ``layers.*.layer_output``, ``layers.6.mlp_output``,
            ``layers.3.self_attn.attention_probabilities``, ``final_norm_output``.
        out: The output directory; a rerun of the same command resumes it.
        engine: ``"transformers"`` (or ``"hf"``) or ``"vllm"``, for a checkpoint path.
        positions: ``"all"`` tokens, the ``"last"`` token of each row, or a function from a row's
            token ids to one keep-flag per token.
        context_length, overflow, add_bos, text_field: How documents become rows (see `ContextSettings`).
        batch_size: Rows per forward on transformers.
        shard_bytes: About how large a shard grows before it is cut (at a row boundary).
        dtype: The dtype activations are stored in (``"float16"``, ``"bfloat16"``, ``"float32"``);
            the model's by default.
        overwrite: Replace a directory made with other settings instead of refusing.
        workers: Ray actors, each with its own model replica and a disjoint share of the shards.
        ray_address: An existing Ray cluster to run the workers on (a local one otherwise).
        model_kwargs: For building the model from a checkpoint (``dtype``, ``device_map``, ...).
        progress: Show a progress bar (the summary line is printed regardless).
    """
    values = [values] if isinstance(values, str) else list(values)
    if positions not in ("all", "last") and not callable(positions):
        raise ValueError(f"positions must be 'all', 'last' or a function of a row's token ids, got {positions!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    settings = ContextSettings(context_length=context_length, overflow=overflow, add_bos=add_bos, text_field=text_field)
    distributed = workers > 1 or ray_address is not None
    if distributed and not isinstance(model, (str, Path)):
        raise ValueError("workers > 1 builds one model per Ray worker: pass a checkpoint path, not a loaded model")
    checkpoint = model
    model = load_model(model, engine, model_kwargs, dispatch=not distributed)
    selections = parse(values, model, context_length)
    dtype = dtype or str(next(model._module.parameters()).dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"dtype must name a torch dtype such as 'float16', 'bfloat16' or 'float32', got {dtype!r}")
    shapes = {selection.name: token_shape(selection, model, context_length) for selection in selections}
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_token = sum(int(torch.tensor(shape).prod()) for shape in shapes.values()) * itemsize
    model_name = str(checkpoint) if isinstance(checkpoint, (str, Path)) else str(model.config._name_or_path)
    store = Store(
        out,
        {
            "model": model_name,
            "config_hash": hashlib.sha256(model.config.to_json_string().encode()).hexdigest(),
            "engine": model.ENGINE,
            "dtype": dtype,
            "values": {name: {"shape": shape} for name, shape in shapes.items()},
            "positions": positions
            if isinstance(positions, str)
            else f"mask from {getattr(positions, '__name__', positions)!s}",
            "context": settings.as_dict(),
            "shard_bytes": shard_bytes,
            "corpus": _fingerprint(corpus),
        },
        overwrite=overwrite,
    )
    job = Job(str(store.out), tuple(selections), positions, context_length, dtype, batch_size)
    stats = CorpusStats()
    units = plan(
        rows(read_documents(corpus, settings=settings), model.tokenizer, settings, stats),
        max(1, shard_bytes // per_token),
    )
    bar = Progress(progress, stats)
    todo = (unit for unit in units if unit.index not in store.done)

    def finished(unit_index: int, record: dict[str, Any]) -> None:
        store.add(unit_index, record, stats.as_dict())
        bar.shard_done(record["tokens"])

    if distributed:
        from .fanout import run_on_ray

        run_on_ray(todo, job, workers, ray_address, model_name, engine, model_kwargs or {}, finished)
    else:
        for unit in todo:
            finished(unit.index, run_unit(model, unit, job))
    store.finish(stats.as_dict())
    print(bar.summary(store.out))
    return load_harvest(store.out)


__all__ = ["Harvest", "HarvestError", "harvest", "load_harvest"]
