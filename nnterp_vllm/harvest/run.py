"""`harvest`: a corpus through a model to activations on disk, streaming, resumable, on either engine.

The corpus becomes context rows (`corpus`), the rows become shards of about
``shard_bytes`` each, cut at row boundaries in corpus order: the plan depends on the
corpus and the settings only, so a rerun, a resumed run and a run fanned out over Ray
workers write the same shards. A shard is computed in batches (rows sorted by length on
transformers, one invoke per row on vLLM, each forward stopped after the deepest value read)
and written atomically in the chosen layout (`layouts`), on a thread while the next shard is
computed, then recorded in the manifest. On
transformers a checkpoint is loaded with sdpa attention unless an attention-interior value is
read (then eager, which exposes it). Each unit carries the digest of the corpus read up to its cut, which its record
keeps: a rerun compares those before it trusts (skips) a recorded shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import in_engine, ranks
from .corpus import ContextSettings, Corpus, CorpusStats, Digested, Row, rows
from .in_engine import CAPTURE_VALUES, EngineHarvester
from .layouts import FORMATS, Columns
from .reader import Harvest, load_harvest
from .resume import Resume
from .selection import ATTENTION_INTERIOR, Selection, Selector, blocks_needed, check_selectors, parse, token_shape
from .store import OVERWRITE, HarvestError, Store, positive_int, write_shard

ENGINES = ("transformers", "vllm")
#: The loaded models a harvest takes, by module and class.
LOADED_MODELS = (("nnterp_vllm.standardized", "Standardized"), ("nnterp_vllm.engines.steered", "SteeredVLLM"))
Positions = str | Callable[[list[int]], list[bool]]


@dataclass
class Unit:
    """One shard's worth of rows: the unit of work, of writing and of resuming."""

    index: int
    rows: list[Row] = field(default_factory=list)
    #: The digest of the corpus as read when this unit was cut (see `plan`).
    corpus_sha256: str | None = None

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
    #: The manifest's settings: the layout a shard is written in follows from them.
    settings: dict[str, Any] = field(default_factory=dict)


def attention_for(selectors: list[Selector]) -> str:
    """The attention implementation a transformers harvest of ``selectors`` loads a checkpoint with:
    eager where an attention-interior value is read (only eager exposes them all), else sdpa."""
    interior = any(selector.key.rsplit(".", 1)[-1] in ATTENTION_INTERIOR for selector in selectors)
    return "eager" if interior else "sdpa"


def attention_of(model: Any) -> str:
    """The attention implementation ``model`` runs: the transformers config's, or vLLM's own kernels."""
    if model.ENGINE == "vllm":
        return "vllm"
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def build_settings(selectors: list[Selector], engine: str, model_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The keyword arguments a harvest of ``selectors`` builds a checkpoint's model with, over the caller's:
    on transformers the attention `attention_for` picks; on vLLM a forward that stops after the deepest
    block read (`blocks_needed`; the engine's ``FIRST_BLOCKS`` setting) and, where the engine keeps every
    selected value itself, the in-engine path's settings (`in_engine.engine_settings`)."""
    kwargs = dict(model_kwargs or {})
    if engine == "transformers":
        kwargs.setdefault("attn_implementation", attention_for(selectors))
        return kwargs
    blocks = blocks_needed(selectors)
    if blocks is not None:
        from ..engines.vllm_platform import FIRST_BLOCKS

        kwargs["additional_config"] = {**(kwargs.get("additional_config") or {}), FIRST_BLOCKS: blocks}
    return in_engine.engine_settings(selectors, kwargs) if in_engine.serves(selectors) else kwargs


def vllm_path(model: Any) -> str | None:
    """Which path a vLLM harvest by ``model`` reads its values on: ``"engine"`` (kept by the engine itself) or
    ``"nnsight"``; ``None`` on transformers."""
    if model.ENGINE != "vllm":
        return None
    return EngineHarvester.PATH if isinstance(model, EngineHarvester) else "nnsight"


def model_dtype(model: Any) -> str:
    """The dtype ``model`` computes in, by name (``"float32"``)."""
    dtype = model.dtype if isinstance(model, EngineHarvester) else next(model._module.parameters()).dtype
    return str(dtype).removeprefix("torch.")


def blocks_run(selectors: list[Selector], model: Any) -> int:
    """How many blocks each forward of a harvest of ``selectors`` by ``model`` runs: on transformers the
    trace stops after the deepest block read; on vLLM the engine runs the blocks it was built to run
    (every block unless built by `build_settings`). ValueError where those stop short of a selected value."""
    needed = blocks_needed(selectors)
    if model.ENGINE != "vllm":
        return model.num_layers if needed is None else min(needed, model.num_layers)
    from ..engines.vllm_platform import FIRST_BLOCKS

    if model.blocks_run < (needed or model.num_layers):
        raise ValueError(
            f"this vLLM model runs only its first {model.blocks_run} blocks (additional_config {FIRST_BLOCKS}), "
            f"short of the values selected, which need {needed or 'all'}: build it without that setting"
        )
    return model.blocks_run


def load_model(model: Any, engine: str, model_kwargs: dict[str, Any] | None = None, dispatch: bool = True) -> Any:
    """The model a harvest reads: ``model`` itself (a `SteeredVLLM` made an `EngineHarvester`), or built from a
    checkpoint on ``engine``: on vLLM, where ``model_kwargs`` name values the engine keeps (`build_settings`), an
    engine keeping them (undispatched: nnsight's weightless tree, which names and sizes the same values)."""
    engine = _engine(engine)
    if not isinstance(model, (str, Path)):
        steered = sys.modules.get("nnterp_vllm.engines.steered")
        return EngineHarvester(model) if steered and isinstance(model, steered.SteeredVLLM) else model
    kwargs = dict(model_kwargs or {})
    if engine == "vllm":
        from ..engines.vllm import StandardizedVLLM

        if CAPTURE_VALUES in kwargs:
            if dispatch:
                return EngineHarvester(model, **kwargs)
            del kwargs[CAPTURE_VALUES]
        return StandardizedVLLM(model, dispatch=dispatch, **kwargs)
    from ..engines.transformers import StandardizedTransformer

    return StandardizedTransformer(model, dispatch=dispatch, **kwargs)


def whole_rows(row_stream: Iterator[Row], length: int, stats: CorpusStats) -> Iterator[Row]:
    """The rows of exactly ``length`` tokens; a shorter (packing's last) row is left out and counted."""
    for row in row_stream:
        if len(row) == length:
            yield row
        else:
            stats.left_out += len(row)


def plan(row_stream: Iterator[Row], tokens_per_shard: int, digest: Callable[[], str] | None = None) -> Iterator[Unit]:
    """Cut rows, in corpus order, into units of at least ``tokens_per_shard`` tokens (the last one short).

    ``digest``, if given, is asked at each cut for the digest of the corpus read so far, and the
    unit keeps it: reading is lazy and in a fixed order, so the same corpus gives the same digests.
    """
    unit = Unit(0)
    for row in row_stream:
        unit.rows.append(row)
        if unit.tokens >= tokens_per_shard:
            unit.corpus_sha256 = digest() if digest else None
            yield unit
            unit = Unit(unit.index + 1)
    if unit.rows:
        unit.corpus_sha256 = digest() if digest else None
        yield unit


def _kept(row: Row, positions: Any) -> slice | torch.Tensor:
    """Which of a row's positions are kept: all (a view of the row's value) or an index (a copy: what is
    left out does not stay in memory with it)."""
    count = len(row.token_ids)
    if positions == "all":
        return slice(None)
    if positions == "last":
        return torch.tensor([count - 1])
    mask = torch.as_tensor(positions(list(row.token_ids)), dtype=torch.bool)
    if mask.shape != (count,):
        raise ValueError(f"the positions mask has shape {tuple(mask.shape)}; expected one flag per token, ({count},)")
    return mask


def compute(model: Any, unit: Unit, job: Job) -> Columns:
    """The shard's columns: metadata and every selected value, one ``[kept tokens, ...]`` part per row, in
    corpus order (a layout writes the parts as they are)."""
    kept_already = False
    if isinstance(model, EngineHarvester):
        per_row = model.values(unit.rows, job.selections, job.positions, job.dtype)
        kept_already = job.positions == "last"  # the engine kept only those rows
    elif model.ENGINE == "vllm":
        per_row = _run_vllm(model, unit.rows, job)
    else:
        per_row = _run_transformers(model, unit.rows, job)
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
            value = values[selection.name] if kept_already else values[selection.name][kept]
            # Expert indices stay integers; activations are stored in the harvest's dtype.
            columns[selection.name].append(value.to(dtype) if value.is_floating_point() else value)
    return columns


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
    import nnsight

    results: list[dict[str, torch.Tensor]] = [{} for _ in unit_rows]
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
    for batch, ids, mask in batches(unit_rows, job.batch_size, pad):
        # No KV cache to build, and nothing runs past the deepest value read (the rest of the
        # blocks, the final norm and the head are skipped).
        with torch.no_grad(), model.trace({"input_ids": ids, "attention_mask": mask}, use_cache=False) as tracer:
            saved = nnsight.save({})
            for selection in job.selections:
                saved[selection.name] = selection.read(model)
            tracer.stop()
        for slot, i in enumerate(batch):
            length = len(unit_rows[i].token_ids)
            results[i] = {
                selection.name: selection.per_token(saved[selection.name][slot : slot + 1], length, job.context_length)
                for selection in job.selections
            }
    return results


def _run_vllm(model: Any, unit_rows: list[Row], job: Job) -> list[dict[str, torch.Tensor]]:
    """One invoke per row, all in one engine call; values per row, in row order."""
    import nnsight

    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        saved = nnsight.save({})
        for number, row in enumerate(unit_rows):
            with tracer.invoke(list(row.token_ids)):
                for selection in job.selections:
                    saved[(number, selection.name)] = selection.read(model)
                # Ends this request's worker: it is not served the logits or the sampled token.
                tracer.stop()
    return [
        {
            selection.name: selection.per_token(saved[(number, selection.name)], len(row.token_ids), job.context_length)
            for selection in job.selections
        }
        for number, row in enumerate(unit_rows)
    ]


def shard_record(unit: Unit, columns: Columns) -> dict[str, Any]:
    """What the manifest says of a shard besides its file and checksum."""
    documents = [document for row in unit.rows for document in row.documents]
    return {
        "index": unit.index,
        "rows": len(unit.rows),
        "row_tokens": unit.tokens,
        "tokens": sum(len(part) for part in columns["token_ids"]),
        "first_document": min(documents),
        "last_document": max(documents),
        "corpus_sha256": unit.corpus_sha256,
    }


def run_unit(model: Any, unit: Unit, job: Job) -> dict[str, Any]:
    """Compute and write one shard; its manifest record."""
    return write_unit(unit, compute(model, unit, job), job)


def write_unit(unit: Unit, columns: Columns, job: Job) -> dict[str, Any]:
    """Write one computed shard; its manifest record."""
    return write_shard(Path(job.out), unit.index, columns, shard_record(unit, columns), job.settings)


class BackgroundWriter:
    """Writes each computed shard on a thread while the next one is computed, one write at a time, and
    records it (``finished(index, record)``) on the caller's thread, in order. Memory: one shard more
    than a computed one. On leaving, a write under way is finished and recorded, even after an error."""

    def __init__(self, job: Job, finished: Callable[[int, dict[str, Any]], None]) -> None:
        self.job = job
        self.finished = finished
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="harvest-writer")
        self.pending: tuple[Unit, Future] | None = None

    def put(self, unit: Unit, columns: Columns) -> None:
        """Write ``columns`` (unit ``unit``) once the write before it is done and recorded."""
        self.drain()
        self.pending = (unit, self.pool.submit(write_unit, unit, columns, self.job))

    def drain(self) -> None:
        """Wait for the write under way and record it (its error, if any, raised here)."""
        if self.pending is not None:
            unit, future = self.pending
            self.pending = None
            self.finished(unit.index, future.result())

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *error: Any) -> None:
        try:
            if error[0] is None:
                self.drain()
            else:
                with contextlib.suppress(Exception):  # the first error is the one to report
                    self.drain()
        finally:
            self.pool.shutdown(wait=True)


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
        left_out = f", {self.stats.left_out} tokens of a last short row left out" if self.stats.left_out else ""
        return (
            f"harvested {self.tokens} tokens in {self.shards} new shards from {self.stats.documents} documents "
            f"({self.stats.empty} empty skipped, {self.stats.truncated} truncated, {self.stats.split} split{left_out}) "
            f"at {self.tokens / seconds:.1f} tokens/s into {out}"
        )


def torch_dtype(name: Any, what: str) -> str:
    """``name`` if it names a torch dtype (``"float16"``...), else ValueError naming ``what``."""
    if not isinstance(name, str) or not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"{what} must name a torch dtype such as 'float16', 'bfloat16' or 'float32', got {name!r}")
    return name


def _engine(engine: Any) -> str:
    """The engine's name (``"hf"`` is ``"transformers"``); ValueError for another."""
    engine = "transformers" if engine == "hf" else engine
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES} (or 'hf')")
    return engine


def _check_arguments(model: Any, out: Any, positions: Any, model_kwargs: Any, **counts: Any) -> None:
    """Refuse arguments no harvest could run with, before anything is loaded or created."""
    # A loaded model exists only if its module is imported.
    kinds = [getattr(sys.modules.get(module), name, None) for module, name in LOADED_MODELS]
    if not isinstance(model, str | os.PathLike) and not any(kind and isinstance(model, kind) for kind in kinds):
        raise TypeError(
            "model must be a checkpoint directory or hub id, a StandardizedTransformer / StandardizedVLLM, or a "
            f"SteeredVLLM built with capture_values; not a {type(model).__name__}"
        )
    if not isinstance(out, str | os.PathLike):
        raise TypeError(f"out must be a directory path, not {out!r}")
    if positions not in ("all", "last") and not callable(positions):
        raise ValueError(f"positions must be 'all', 'last' or a function of a row's token ids, got {positions!r}")
    if model_kwargs is not None and not isinstance(model_kwargs, dict):
        raise TypeError(f"model_kwargs must be a dict of keyword arguments, not {model_kwargs!r}")
    for what, value in counts.items():
        positive_int(value, what)


def _check_format(
    format: Any, context_length: int | None, overflow: str | None, positions: Any, dtype: str | None
) -> str:
    """The overflow mode ``format`` runs with; ValueError for what the format cannot hold."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if format != "sae-lens":
        return overflow or "truncate"
    why = "format='sae-lens' holds one row per sequence of exactly context_length tokens"
    if context_length is None:
        raise ValueError(f"{why}: give a context_length (--context-length)")
    if overflow not in (None, "pack"):
        raise ValueError(f"{why}: overflow must be 'pack' (the default for this format), not {overflow!r}")
    if positions != "all":
        raise ValueError(f"{why}: positions must be 'all', not {positions!r}")
    if dtype not in (None, "float32", "float16"):
        raise ValueError(f"format='sae-lens' stores 'float32' or 'float16' activations, not dtype={dtype!r}")
    return "pack"


def _value_entries(selections: list[Selection], model: Any, context_length: int | None, format: str) -> dict:
    """The manifest's ``values``: each value's per-token shape and module path (and, for sae-lens, its column)."""
    entries: dict[str, dict[str, Any]] = {}
    columns: dict[str, str] = {}
    for selection in selections:
        module = model.module_path(selection) if isinstance(model, EngineHarvester) else selection.module_path(model)
        entry = {"shape": token_shape(selection, model, context_length), "module": module}
        if format == "sae-lens":
            if module is None:
                raise ValueError(
                    f"{selection.name} is no module's output, and SAELens names activations by the module it hooks: "
                    "harvest a layer_output, attention_output or mlp_output (or the default format)"
                )
            if module in columns:
                raise ValueError(f"{columns[module]} and {selection.name} are both the output of {module}: keep one")
            columns[module] = selection.name
            entry["column"] = module
        entries[selection.name] = entry
    return entries


def _units(
    documents: Digested,
    tokenizer: Any,
    settings: ContextSettings,
    tokens_per_shard: int,
    whole: bool,
    stats: CorpusStats,
) -> Iterator[Unit]:
    row_stream = rows(documents, tokenizer, settings, stats)
    if whole:
        row_stream = whole_rows(row_stream, settings.context_length, stats)
    return plan(row_stream, tokens_per_shard, documents.hexdigest)


def harvest(
    model: Any,
    corpus: Any,
    values: list[str] | str,
    out: Path | str,
    *,
    engine: str = "transformers",
    format: str = "safetensors",
    positions: Positions = "all",
    context_length: int | None = None,
    overflow: str | None = None,
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
            A checkpoint loads on transformers with sdpa attention, or eager when an attention-interior
            value (queries, keys, values, scores, probabilities, premix, head outputs) is selected;
            ``model_kwargs={"attn_implementation": ...}`` overrides. A model passed in keeps its own.
            The manifest's ``attention`` says what ran. Each forward stops after the deepest block a
            selected value lies in (on vLLM, for a checkpoint the harvest builds itself; a vLLM model
            passed in runs every block, its reads stopping there); the manifest's ``blocks_run`` says how
            many ran.
        corpus: A .txt file (a document per line), a directory of .txt files, a .jsonl file, a
            ``datasets`` dataset (object or saved directory), or a list of texts or of token-id lists.
        values: Selectors such as ``layers.*.layer_output``, ``layers.6.mlp_output``,
            ``layers.3.self_attn.attention_probabilities``, ``final_norm_output``.
        out: The output directory; a rerun of the same command resumes it.
        engine: ``"transformers"`` (or ``"hf"``) or ``"vllm"``, for a checkpoint path.
        format: ``"safetensors"`` shards (the default), or ``"sae-lens"``: the directory is a
            ``datasets`` dataset that SAELens's cached-activation training reads as it is (one row per
            sequence of exactly ``context_length`` tokens, a column per value named by its module path;
            see `layouts`). It needs a ``context_length``, packs documents into rows (``overflow="pack"``,
            the last short row is left out and counted), keeps every position, and stores float32 or float16.
        positions: ``"all"`` tokens, the ``"last"`` token of each row, or a function from a row's
            token ids to one keep-flag per token.
        context_length, overflow, add_bos, text_field: How documents become rows (see `ContextSettings`);
            ``overflow`` defaults to ``"truncate"`` (``"pack"`` for the sae-lens format).
        batch_size: Rows per forward on transformers.
        shard_bytes: About how large a shard grows before it is cut (at a row boundary).
        dtype: The dtype activations are stored in (``"float16"``, ``"bfloat16"``, ``"float32"``);
            the model's by default.
        overwrite: Replace a directory made with other settings instead of refusing.
        workers: Ray actors, each with its own model replica and a disjoint share of the shards.
        ray_address: An existing Ray cluster to run the workers on (a local one otherwise).
        model_kwargs: For building the model from a checkpoint (``dtype``, ``device_map``, ...). On vLLM
            ``tensor_parallel_size=T`` splits each replica over T ranks; on transformers ``tp_size=T`` (or
            ``tp_plan="auto"``) splits the model over the T processes ``torchrun`` started, each running this
            call: every rank runs every forward, rank 0 alone writes, and every rank returns the harvest.
        progress: Show a progress bar (the summary line is printed regardless).
    """
    selectors = check_selectors(values, context_length)
    _check_arguments(
        model, out, positions, model_kwargs, batch_size=batch_size, workers=workers, shard_bytes=shard_bytes
    )
    engine = _engine(engine)
    if dtype is not None:
        torch_dtype(dtype, "dtype")
    overflow = _check_format(format, context_length, overflow, positions, dtype)
    settings = ContextSettings(context_length=context_length, overflow=overflow, add_bos=add_bos, text_field=text_field)
    distributed = workers > 1 or ray_address is not None
    if distributed and not isinstance(model, str | Path):
        raise ValueError("workers > 1 builds one model per Ray worker: pass a checkpoint path, not a loaded model")
    source = Corpus(corpus, settings)
    model_kwargs = build_settings(selectors, engine, model_kwargs) if isinstance(model, str | Path) else {}
    sharded = ranks.sharded_transformers(model, engine, model_kwargs)
    if sharded and distributed:
        raise ValueError(
            "a transformers harvest split by tensor parallelism runs its ranks under torchrun, not on Ray workers: "
            "drop workers / ray_address, or harvest on vLLM"
        )
    if sharded and ranks.rank() != 0:
        ranks.follow(load_model(model, engine, model_kwargs), compute)
        return load_harvest(out)
    with Store(out, overwrite) as store, contextlib.ExitStack() as built:
        checkpoint = model
        model = load_model(model, engine, model_kwargs, dispatch=not distributed)
        if model is not checkpoint and model.ENGINE == "vllm":
            built.callback(model.shutdown)
        leader = built.enter_context(ranks.lead(sharded))
        selections = parse(selectors, model, context_length)
        dtype = dtype or model_dtype(model)
        if format == "sae-lens" and dtype not in ("float32", "float16"):
            raise ValueError(
                f"format='sae-lens' stores 'float32' or 'float16' activations: the model's {dtype} "
                "cannot be; pass dtype='float32' or dtype='float16'"
            )
        entries = _value_entries(selections, model, context_length, format)
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        per_token = sum(int(torch.tensor(entry["shape"]).prod()) for entry in entries.values()) * itemsize
        model_name = str(checkpoint) if isinstance(checkpoint, str | Path) else str(model.config._name_or_path)
        store.begin(
            {
                "model": model_name,
                "config_hash": hashlib.sha256(model.config.to_json_string().encode()).hexdigest(),
                "engine": model.ENGINE,
                "attention": attention_of(model),
                "blocks_run": blocks_run(selectors, model),
                "vllm_path": "engine" if CAPTURE_VALUES in model_kwargs else vllm_path(model),
                "dtype": dtype,
                "format": format,
                "values": entries,
                "positions": positions
                if isinstance(positions, str)
                else f"mask from {getattr(positions, '__name__', positions)!s}",
                "context": settings.as_dict(),
                "shard_bytes": shard_bytes,
                "corpus": source.description,
            }
        )
        tokens_per_shard = max(1, shard_bytes // per_token)
        whole = format == "sae-lens"
        resume = Resume(store)
        if resume.needs_proof():
            if source.one_shot:
                raise HarvestError(
                    f"{store.out} has shards to compute before shards already recorded; checking that the corpus "
                    "still matches those takes a pass of its own, and a one-shot iterable (a generator) can be "
                    f"read only once: pass a list, a file or a dataset, or use {OVERWRITE}"
                )
            documents = source.read()
            units = _units(documents, model.tokenizer, settings, tokens_per_shard, whole, CorpusStats())
            resume.prove_recorded(units, documents)
        job = Job(str(store.out), tuple(selections), positions, context_length, dtype, batch_size, store.settings)
        stats = CorpusStats()
        documents = source.read()
        units = _units(documents, model.tokenizer, settings, tokens_per_shard, whole, stats)
        bar = Progress(progress, stats)
        todo = resume.pending(units, documents)

        def finished(unit_index: int, record: dict[str, Any]) -> None:
            store.add(unit_index, record, stats.as_dict())
            bar.shard_done(record["tokens"])

        if distributed:
            from .fanout import run_on_ray

            run_on_ray(todo, job, workers, ray_address, model_name, engine, model_kwargs, finished)
        else:
            with BackgroundWriter(job, finished) as writer:
                for unit in todo:
                    if leader is not None:
                        leader.send(unit, job)
                    writer.put(unit, compute(model, unit, job))
        store.finish(stats.as_dict(), documents.hexdigest())
        print(bar.summary(store.out))
    return load_harvest(store.out)


__all__ = ["Harvest", "HarvestError", "harvest", "load_harvest"]
