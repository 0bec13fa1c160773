"""One shard's work: the unit of rows, the job's settings, the model that reads it and how a shard is
computed and written.

The model is a checkpoint built for the harvest (`build_settings`: sdpa or eager attention on
transformers; on vLLM only the blocks read, and the in-engine path where the engine keeps every value)
or a model passed in. A shard is computed in batches (rows sorted by length on transformers, one invoke
per row on vLLM's nnsight path, each forward stopped after the deepest value read; every row in one
engine call on the in-engine path) and written atomically in the chosen layout.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..components.names import ATTENTION_INTERIOR
from ..specs.selection import Selection, Selector, blocks_needed
from . import in_engine
from .corpus import Row
from .in_engine import CAPTURE_VALUES, EngineHarvester
from .layouts import METADATA, Columns
from .location import Location
from .store import Placed, write_shard

ENGINES = ("transformers", "vllm")


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
    #: How to reach ``out`` where it is a URL (fsspec's ``storage_options``; never written to the manifest).
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)

    def location(self) -> Location:
        """Where the shards go (`location.Location`)."""
        return Location.of(self.out, self.storage_options)


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
        from ..engines.first_blocks import FIRST_BLOCKS

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
    return str(model.dtype).removeprefix("torch.")


def blocks_run(selectors: list[Selector], model: Any) -> int:
    """How many blocks each forward of a harvest of ``selectors`` by ``model`` runs: on transformers the
    trace stops after the deepest block read; on vLLM the engine runs the blocks it was built to run
    (every block unless built by `build_settings`). ValueError where those stop short of a selected value."""
    needed = blocks_needed(selectors)
    if model.ENGINE != "vllm":
        return model.num_layers if needed is None else min(needed, model.num_layers)
    from ..engines.first_blocks import FIRST_BLOCKS

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
    engine = engine_name(engine)
    if not isinstance(model, (str, Path)):
        steered = sys.modules.get("nnterp_vllm.engines.steered.engine")
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


def metadata(unit_rows: list[Row], positions: Any) -> tuple[Columns, list[slice | torch.Tensor]]:
    """A shard's metadata columns (``token_ids``, ``documents``, ``offsets``, ``rows``), one part per row at its kept
    positions; and per row those positions (`_kept`)."""
    columns: Columns = {name: [] for name in METADATA}
    kept_positions = []
    for number, row in enumerate(unit_rows):
        kept = _kept(row, positions)
        columns["token_ids"].append(torch.tensor(row.token_ids, dtype=torch.int64)[kept])
        columns["documents"].append(torch.tensor(row.documents, dtype=torch.int64)[kept])
        columns["offsets"].append(torch.tensor(row.offsets, dtype=torch.int64)[kept])
        columns["rows"].append(torch.full(columns["token_ids"][-1].shape, number, dtype=torch.int64))
        kept_positions.append(kept)
    return columns, kept_positions


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
    columns, kept_positions = metadata(unit.rows, job.positions)
    columns.update({selection.name: [] for selection in job.selections})
    for values, kept in zip(per_row, kept_positions):
        for selection in job.selections:
            value = values[selection.name] if kept_already else values[selection.name][kept]
            # Expert indices stay integers; activations are stored in the harvest's dtype, probe scores in float32.
            dtype = getattr(torch, selection.stored_dtype(job.dtype))
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
        device = next(model._module.parameters()).device  # meta until the first trace loads the weights
        inputs = {"input_ids": ids, "attention_mask": mask}
        if device.type != "meta":
            inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
        # No KV cache to build, and nothing runs past the deepest value read (the rest of the
        # blocks, the final norm and the head are skipped).
        with torch.no_grad(), model.trace(inputs, use_cache=False) as tracer:
            saved = nnsight.save({})
            for selection in job.selections:
                if selection.source not in saved:
                    saved[selection.source] = selection.read(model)
            tracer.stop()
        saved = {name: value.to("cpu") for name, value in saved.items()}  # one copy off the device per batch
        for slot, i in enumerate(batch):
            length = len(unit_rows[i].token_ids)
            results[i] = {
                selection.name: selection.per_token(
                    saved[selection.source][slot : slot + 1], length, job.context_length
                )
                for selection in job.selections
            }
    return results


def _run_vllm(model: Any, unit_rows: list[Row], job: Job) -> list[dict[str, torch.Tensor]]:
    """One invoke per row, all in one engine call; values per row, in row order."""
    import nnsight

    with model.trace() as tracer:
        saved = nnsight.save({})
        for number, row in enumerate(unit_rows):
            with tracer.invoke(list(row.token_ids)):
                for selection in job.selections:
                    if (number, selection.source) not in saved:
                        saved[(number, selection.source)] = selection.read(model)
                # Ends this request's worker: it is not served the logits or the sampled token.
                tracer.stop()
    return [
        {
            selection.name: selection.per_token(
                saved[(number, selection.source)], len(row.token_ids), job.context_length
            )
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


def write_unit(unit: Unit, columns: Columns, job: Job, placed: Placed | None = None) -> dict[str, Any]:
    """Write one computed shard (``placed``: filled in place, `store.Placed`); its manifest record."""
    return write_shard(job.location(), unit.index, columns, shard_record(unit, columns), job.settings, placed)


def engine_name(engine: Any) -> str:
    """The engine's name (``"hf"`` is ``"transformers"``); ValueError for another."""
    engine = "transformers" if engine == "hf" else engine
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES} (or 'hf')")
    return engine
