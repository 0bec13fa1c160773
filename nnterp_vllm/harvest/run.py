"""`harvest`: a corpus through a model to activations on disk, streaming, resumable, on either engine.

The corpus becomes context rows (`corpus`), the rows become shards of about
``shard_bytes`` each, cut at row boundaries in corpus order: the plan depends on the
corpus and the settings only, so a rerun, a resumed run and a run fanned out over Ray
workers (`fanout`) write the same shards. Each shard is computed (`compute`; on vLLM's in-engine path the
engine is fed across shards as one stream, `pipeline`) and written on a thread while the next ones are
computed (`BackgroundWriter`, a bounded queue), then recorded in the manifest. Each unit carries the
digest of the corpus read up to its cut, which its record keeps: a rerun compares those before it
trusts (skips) a recorded shard (`resume`).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..specs.selection import (
    PROBE_DTYPE,
    Selection,
    check_selectors,
    parse,
    token_shape,
)
from . import pipeline, ranks
from .compute import (
    Job,
    Unit,
    attention_of,
    blocks_run,
    build_settings,
    compute,
    engine_name,
    load_model,
    model_dtype,
    vllm_path,
    write_unit,
)
from .corpus import ContextSettings, Corpus, CorpusStats, Digested, Row, rows
from .in_engine import CAPTURE_VALUES, EngineHarvester
from .layouts import FORMATS, Columns
from .location import Location
from .reader import Harvest, load_harvest
from .resume import Resume
from .store import OVERWRITE, HarvestError, Placed, Store, positive_int

#: The loaded models a harvest takes, by module and class.
LOADED_MODELS = (("nnterp_vllm.standardized", "Standardized"), ("nnterp_vllm.engines.steered.engine", "SteeredVLLM"))
Positions = str | Callable[[list[int]], list[bool]]


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


#: Computed shards the writer holds at most: the one being written and the next. A harvest computing faster than
#: its disk takes waits only when both are taken.
WRITES_QUEUED = 2


class BackgroundWriter:
    """Writes computed shards on a thread, in order, one at a time, while the next ones are computed, and records
    each (``finished(index, record)``) on the caller's thread, in order. At most `WRITES_QUEUED` shards wait or are
    being written: `put` waits for the oldest when the queue is full. On leaving, the writes under way are
    finished and recorded, even after an error."""

    def __init__(self, job: Job, finished: Callable[[int, dict[str, Any]], None]) -> None:
        self.job = job
        self.finished = finished
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="harvest-writer")
        self.pending: collections.deque[tuple[Unit, Future]] = collections.deque()

    def put(self, unit: Unit, columns: Columns, placed: Placed | None = None) -> None:
        """Queue ``columns`` (unit ``unit``; ``placed``: filled in place, `write_unit`) for writing, once there is
        room; record the writes done meanwhile."""
        while self.pending and (len(self.pending) >= WRITES_QUEUED or self.pending[0][1].done()):
            self.record_oldest()
        self.pending.append((unit, self.pool.submit(write_unit, unit, columns, self.job, placed)))

    def record_oldest(self) -> None:
        """Wait for the oldest write and record it (its error, if any, raised here)."""
        unit, future = self.pending.popleft()
        self.finished(unit.index, future.result())

    def drain(self) -> None:
        """Wait for every queued write and record it."""
        while self.pending:
            self.record_oldest()

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
    """A progress bar with documents, tokens and tokens/s, and the MB/s written beside them; the closing summary."""

    def __init__(self, enabled: bool, stats: CorpusStats) -> None:
        from tqdm.auto import tqdm

        self.stats = stats
        self.start = time.perf_counter()
        self.tokens = 0
        self.bytes = 0
        self.shards = 0
        self.bar = tqdm(unit=" tok", unit_scale=True, disable=not enabled, desc="harvest")

    def rate(self) -> float:
        """Megabytes (10^6) of shards written per second so far."""
        return self.bytes / 1e6 / max(time.perf_counter() - self.start, 1e-9)

    def shard_done(self, tokens: int, written: int) -> None:
        self.tokens += tokens
        self.bytes += written
        self.shards += 1
        self.bar.update(tokens)
        postfix = {"MB/s": f"{self.rate():.1f}", "documents": self.stats.documents, "shards": self.shards}
        self.bar.set_postfix(postfix, refresh=False)

    def summary(self, out: Any) -> str:
        self.bar.close()
        seconds = max(time.perf_counter() - self.start, 1e-9)
        left_out = f", {self.stats.left_out} tokens of a last short row left out" if self.stats.left_out else ""
        return (
            f"harvested {self.tokens} tokens in {self.shards} new shards from {self.stats.documents} documents "
            f"({self.stats.empty} empty skipped, {self.stats.truncated} truncated, {self.stats.split} split{left_out}) "
            f"at {self.tokens / seconds:.1f} tokens/s, {self.rate():.1f} MB/s written, into {out}"
        )


def torch_dtype(name: Any, what: str) -> str:
    """``name`` if it names a torch dtype (``"float16"``...), else ValueError naming ``what``."""
    if not isinstance(name, str) or not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"{what} must name a torch dtype such as 'float16', 'bfloat16' or 'float32', got {name!r}")
    return name


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
        raise TypeError(f"out must be a directory path or a URL (s3://bucket/run, ...), not {out!r}")
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
    """The manifest's ``values``: each value's per-token shape and module path (and, for sae-lens, its column; for
    an SAE's features, the SAE: its name, directory, hook and digest; for a probe's scores, their dtype and the
    probe: its block, weight shape, activation and the digest of its block, weight and bias)."""
    entries: dict[str, dict[str, Any]] = {}
    columns: dict[str, str] = {}
    for selection in selections:
        module = model.module_path(selection) if isinstance(model, EngineHarvester) else selection.module_path(model)
        entry = {"shape": token_shape(selection, model, context_length), "module": module}
        if selection.value == "sae_features":
            sae = model.saes.at(selection.layer)
            entry["sae"] = {"name": sae.name, "path": sae.path, "hook": sae.hook, "digest": sae.digest}
        if selection.probe is not None:
            name, probe = selection.probe
            read = probe.resolved(name, model.num_layers, model.hidden_size)
            entry["dtype"] = PROBE_DTYPE
            entry["probe"] = {
                "layer": read["layer"],
                "weight_shape": list(probe.weight.shape),
                "activation": probe.activation,
                "digest": read["digest"],
            }
        if format == "sae-lens":
            # A probe's scores are a column of their own, under their name.
            column = selection.name if selection.probe is not None else module
            if column is None:
                raise ValueError(
                    f"{selection.name} is no module's output, and SAELens names activations by the module it hooks: "
                    "harvest a layer_output, attention_output or mlp_output (or the default format)"
                )
            if column in columns:
                raise ValueError(f"{columns[column]} and {selection.name} are both the output of {column}: keep one")
            columns[column] = selection.name
            entry["column"] = column
        entries[selection.name] = entry
    return entries


def value_bytes(entries: dict[str, dict[str, Any]], dtype: str) -> int:
    """Bytes of one token's values (the manifest's ``values`` ``entries``) stored in ``dtype`` (or their own)."""

    def itemsize(entry: dict[str, Any]) -> int:
        return torch.empty((), dtype=getattr(torch, entry.get("dtype", dtype))).element_size()

    return sum(int(torch.tensor(entry["shape"]).prod()) * itemsize(entry) for entry in entries.values())


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
    storage_options: dict[str, Any] | None = None,
    shared_filesystem: bool = False,
    probes: dict[str, Any] | None = None,
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
            ``layers.3.self_attn.attention_probabilities``, ``final_norm_output``; ``probes.NAME`` for the
            scores of the probe ``NAME`` of ``probes``.
        out: The output directory, or any fsspec URL (``s3://bucket/run``, ``gs://``, ``az://``, ``file://``):
            every replica writes its shards straight there; a rerun of the same command resumes it.
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
        model_kwargs: For building the model from a checkpoint (``dtype``: the checkpoint's own on both
            engines unless given; ``device_map``, ...); the manifest's ``model_dtype`` says what ran. On vLLM
            ``tensor_parallel_size=T`` splits each replica over T ranks; on transformers ``tp_size=T`` (or
            ``tp_plan="auto"``) splits the model over the T processes ``torchrun`` started, each running this
            call: every rank runs every forward, rank 0 alone writes, and every rank returns the harvest.
        progress: Show a progress bar (the summary line is printed regardless).
        storage_options: How to reach a URL ``out`` (fsspec's, e.g. ``{"endpoint_url": ..., "profile": ...}``);
            by default the store's usual environment and config (for S3 ``AWS_ACCESS_KEY_ID``,
            ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``, profiles). Never written to the manifest.
        shared_filesystem: Declare a local ``out`` a file system every Ray node mounts at the same path: without
            it, a local ``out`` with replicas on nodes other than this one is refused before any work; with it,
            each landed shard is checked here.
        probes: Linear probes by name (`specs.probes.Probe`, reading every position: the harvest's
            ``positions`` choose the tokens), each harvested as ``probes.NAME``: its scores per token, after its
            activation, in float32 (``[tokens]`` for a one-score probe, ``[tokens, classes]`` otherwise). On vLLM's
            in-engine path the engine reads them itself (built with a probe column per class; a `SteeredVLLM`
            passed in needs ``max_probe_columns`` that many); elsewhere they are computed from the block's
            ``layer_output``, as the engine computes them. Every probe given must be harvested; the manifest
            records each (its block, weight shape, activation and digest).
    """
    from ..specs.probes import probes_of

    selectors = check_selectors(values, context_length, probes_of(probes))
    _check_arguments(
        model, out, positions, model_kwargs, batch_size=batch_size, workers=workers, shard_bytes=shard_bytes
    )
    engine = engine_name(engine)
    location = Location.of(out, storage_options)
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
        return load_harvest(out, storage_options=storage_options)
    with Store(location, overwrite) as store, contextlib.ExitStack() as built:
        checkpoint = model
        model = load_model(model, engine, model_kwargs, dispatch=not distributed)
        if model is not checkpoint and model.ENGINE == "vllm":
            built.callback(model.shutdown)
        leader = built.enter_context(ranks.lead(sharded))
        selections = parse(selectors, model, context_length)
        if isinstance(model, EngineHarvester):
            model.check_probes(selections)
        dtype = dtype or model_dtype(model)
        if format == "sae-lens" and dtype not in ("float32", "float16"):
            raise ValueError(
                f"format='sae-lens' stores 'float32' or 'float16' activations: the model's {dtype} "
                "cannot be; pass dtype='float32' or dtype='float16'"
            )
        entries = _value_entries(selections, model, context_length, format)
        per_token = value_bytes(entries, dtype)
        model_name = str(checkpoint) if isinstance(checkpoint, str | Path) else str(model.config._name_or_path)
        store.begin(
            {
                "model": model_name,
                "config_hash": hashlib.sha256(model.config.to_json_string().encode()).hexdigest(),
                "engine": model.ENGINE,
                "attention": attention_of(model),
                "blocks_run": blocks_run(selectors, model),
                "vllm_path": "engine" if CAPTURE_VALUES in model_kwargs else vllm_path(model),
                "engine_process": model.engine_process if isinstance(model, EngineHarvester) else None,
                "dtype": dtype,
                "model_dtype": model_dtype(model),
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
        job = Job(
            str(store.out),
            tuple(selections),
            positions,
            context_length,
            dtype,
            batch_size,
            store.settings,
            location.storage_options,
        )
        stats = CorpusStats()
        documents = source.read()
        units = _units(documents, model.tokenizer, settings, tokens_per_shard, whole, stats)
        bar = Progress(progress, stats)
        todo = resume.pending(units, documents)

        def finished(unit_index: int, record: dict[str, Any]) -> None:
            store.add(unit_index, record, stats.as_dict())
            bar.shard_done(record["tokens"], record["bytes"])

        if distributed:
            from .fanout import run_on_ray

            run_on_ray(todo, job, workers, ray_address, model_name, engine, model_kwargs, finished, shared_filesystem)
        else:
            with BackgroundWriter(job, finished) as writer:
                if isinstance(model, EngineHarvester):
                    with contextlib.closing(pipeline.shards(model, todo, job)) as computed:
                        for unit, columns, placed in computed:
                            writer.put(unit, columns, placed)
                else:
                    for unit in todo:
                        if leader is not None:
                            leader.send(unit, job)
                        writer.put(unit, compute(model, unit, job))
        store.finish(stats.as_dict(), documents.hexdigest())
        print(bar.summary(store.out))
    return load_harvest(out, storage_options=storage_options)


__all__ = ["Harvest", "HarvestError", "harvest", "load_harvest"]
