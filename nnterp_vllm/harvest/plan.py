"""``harvest --plan``: what a harvest will write, and the write bandwidth its store needs, before any engine runs.

The model is built weightless (no engine, no weights: nnsight's meta tree, which names and sizes every value) and
the corpus read through the tokenizer into the harvest's own rows, so the figures are the harvest's: bytes per
token of the selected values (and of the four per-token metadata columns), the whole run's size, and, for the
engine's tokens/s (as a harvest's summary line or `benchmarks/harvest.py` measures it), the bandwidth the store must
sustain to keep up.
"""

from __future__ import annotations

from typing import Any

from ..specs.selection import check_selectors, parse
from .compute import build_settings, engine_name, load_model, model_dtype
from .corpus import ContextSettings, Corpus, CorpusStats, rows
from .layouts import METADATA
from .run import _check_format, _value_entries, value_bytes, whole_rows

#: Bytes of a token's metadata columns (``token_ids``, ``documents``, ``offsets``, ``rows``: int64 each).
METADATA_BYTES = 8 * len(METADATA)


def plan(
    model: str,
    corpus: Any,
    values: list[str] | str,
    *,
    engine: str = "transformers",
    format: str = "safetensors",
    positions: str = "all",
    context_length: int | None = None,
    overflow: str | None = None,
    add_bos: bool = True,
    text_field: str = "text",
    dtype: str | None = None,
    model_kwargs: dict[str, Any] | None = None,
    tokens_per_second: float | None = None,
    probes: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The I/O plan of the harvest these arguments (as `harvest` takes them) describe: ``bytes_per_token``,
    ``tokens`` kept over the corpus, ``total_bytes``, and, given the engine's tokens/s (``tokens_per_second``: what
    a harvest's progress bar or summary line shows, or a benchmark's), ``write_bytes_per_second`` the store needs."""
    if positions not in ("all", "last"):
        raise ValueError(f"--plan takes positions 'all' or 'last', got {positions!r}")
    if tokens_per_second is not None and not tokens_per_second > 0:
        raise ValueError(f"tokens_per_second must be a positive number, got {tokens_per_second!r}")
    from ..specs.probes import probes_of

    selectors = check_selectors(values, context_length, probes_of(probes))
    engine = engine_name(engine)
    overflow = _check_format(format, context_length, overflow, positions, dtype)
    settings = ContextSettings(context_length=context_length, overflow=overflow, add_bos=add_bos, text_field=text_field)
    source = Corpus(corpus, settings)
    built = load_model(model, engine, build_settings(selectors, engine, model_kwargs), dispatch=False)
    selections = parse(selectors, built, context_length)
    dtype = dtype or model_dtype(built)
    per_token = value_bytes(_value_entries(selections, built, context_length, format), dtype) + METADATA_BYTES
    stats = CorpusStats()
    stream = rows(source.read(), built.tokenizer, settings, stats)
    if format == "sae-lens":
        stream = whole_rows(stream, context_length, stats)
    tokens = sum(len(row) if positions == "all" else 1 for row in stream)
    return {
        "values": [selection.name for selection in selections],
        "dtype": dtype,
        "bytes_per_token": per_token,
        "value_bytes_per_token": per_token - METADATA_BYTES,
        "tokens": tokens,
        "documents": stats.documents,
        "total_bytes": tokens * per_token,
        "tokens_per_second": tokens_per_second,
        "write_bytes_per_second": tokens_per_second * per_token if tokens_per_second else None,
    }


def describe(found: dict[str, Any]) -> str:
    """The plan as the command line prints it."""
    lines = [
        f"values: {len(found['values'])} ({', '.join(found['values'][:4])}{' ...' if len(found['values']) > 4 else ''})"
        f" in {found['dtype']}",
        f"bytes per token: {found['bytes_per_token']:,} ({found['value_bytes_per_token']:,} of values, "
        f"{METADATA_BYTES} of token metadata)",
        f"the run: {found['tokens']:,} tokens kept from {found['documents']:,} documents, "
        f"{found['total_bytes'] / 1e9:,.3f} GB",
    ]
    if found["write_bytes_per_second"]:
        lines.append(
            f"to keep up with {found['tokens_per_second']:,.0f} tokens/s, the store must "
            f"take {found['write_bytes_per_second'] / 1e6:,.1f} MB/s"
        )
    else:
        lines.append("give the engine's tokens/s (--tokens-per-second) for the write bandwidth the store needs")
    return "\n".join(lines)


__all__ = ["describe", "plan"]
