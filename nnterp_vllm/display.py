"""Displays: nnterp's logit-lens heatmap of top tokens per layer and prompts as a table; a sweep's scores; a patching
sweep's heat map.

Plots are drawn with matplotlib (the ``display`` extra: ``pip install 'nnterp_vllm[display]'``).
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .prompt_utils import Prompt


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "the plots draw with matplotlib: pip install 'nnterp_vllm[display]' (or matplotlib)"
        ) from error
    return Figure


def _as_batch(probs: Any) -> torch.Tensor:
    """``[vocab]``, ``[layers, vocab]`` or ``[batch, layers, vocab]`` probabilities as ``[batch, layers, vocab]``."""
    if not isinstance(probs, torch.Tensor) or not 1 <= probs.dim() <= 3:
        shape = list(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise ValueError(
            f"plot_topk_tokens: next_token_probs must be a [vocab], [layers, vocab] or [batch, layers, vocab] "
            f"tensor (e.g. logit_lens' result), got {shape}"
        )
    probs = probs.detach().float().cpu()
    while probs.dim() < 3:
        probs = probs.unsqueeze(0)
    return probs


def plot_topk_tokens(
    next_token_probs: torch.Tensor,
    tokenizer: Any,
    k: int = 4,
    title: str | None = None,
    use_token_ids: bool = False,
    file: str | Path | None = None,
    save_html: bool = True,
    height: int = 300,
    width: int = 400,
) -> Any:
    """A heatmap per prompt of the ``k`` most probable tokens at each layer (e.g. of `logit_lens`' result).

    Rows are layers, columns the top-``k`` ranks; each cell shows the token (or its id, with
    ``use_token_ids``) coloured by its probability. Up to three prompts per row of panels, each
    ``width`` x ``height`` pixels (taller where there are many layers). With ``file``, the figure is
    saved there in the format its suffix names (``.png``, ``.svg``, ``.pdf``, ...); ``.html`` (or
    ``save_html`` beside an image) writes a page showing the image. Returns the matplotlib ``Figure``.
    """
    figure_class = _figure_class()
    probs = _as_batch(next_token_probs)
    batch, layers, vocab = probs.shape
    if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= vocab:
        raise ValueError(f"plot_topk_tokens: k must be an int in 1..{vocab} (the vocabulary), got {k!r}")
    top = probs.topk(k, dim=-1)
    columns = min(3, batch)
    rows = math.ceil(batch / columns)
    panel_height = max(height, 22 * layers + 90)
    figure = figure_class(figsize=(width * columns / 100, panel_height * rows / 100), dpi=100, layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    image = None
    for index, axis in enumerate(axes.flat):
        if index >= batch:
            axis.set_axis_off()
            continue
        image = axis.imshow(top.values[index], cmap="RdBu_r", vmin=0, vmax=1, aspect="auto", origin="lower")
        for layer in range(layers):
            for rank in range(k):
                token = int(top.indices[index, layer, rank])
                label = str(token) if use_token_ids else repr(tokenizer.decode([token]))
                dark = abs(float(top.values[index, layer, rank]) - 0.5) > 0.3  # the map's ends are dark
                axis.text(rank, layer, label, ha="center", va="center", fontsize=7, color="white" if dark else "black")
        axis.set_xticks(range(k))
        axis.set_yticks(range(layers))
        axis.set_xlabel("Tokens")
        axis.set_ylabel("Layers")
        if batch > 1:
            axis.set_title(f"prompt {index}", fontsize=9)
    figure.colorbar(image, ax=axes, label="Probability", shrink=0.9)
    figure.suptitle(title or f"Top {k} Tokens Heatmap")
    if file is not None:
        _save(figure, Path(file), save_html)
    return figure


def _save(figure: Any, file: Path, save_html: bool) -> None:
    """Save ``figure`` to ``file`` (an image format by suffix, or ``.html``), with an HTML page beside it if asked."""
    if file.suffix != ".html":
        figure.savefig(file, dpi=150)
    if save_html or file.suffix == ".html":
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=150)
        encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
        page = (
            f'<!doctype html>\n<html><body><img alt="top tokens" src="data:image/png;base64,{encoded}"></body></html>\n'
        )
        (file if file.suffix == ".html" else file.with_suffix(".html")).write_text(page)


def prompts_to_df(prompts: list[Prompt], tokenizer: Any = None) -> Any:
    """A pandas table of prompts (one column each): the prompt, each target's strings, and with ``tokenizer``
    each target's tokens."""
    import pandas

    table: dict[int, dict[str, Any]] = {}
    for index, prompt in enumerate(prompts):
        table[index] = {"prompt": prompt.prompt}
        for target, strings in (prompt.target_strings or {}).items():
            table[index][f"{target}_string"] = strings
        if tokenizer is not None:
            for target, tokens in prompt.target_tokens.items():
                table[index][f"{target}_tokens"] = tokenizer.convert_ids_to_tokens(tokens)
    return pandas.DataFrame.from_dict(table)


def plot_sweep_scores(
    table: Sequence[dict], score: str, file: str | Path | None = None, vector: str | None = None
) -> Any:
    """A plot of ``score`` (a score column's name, ``"score: <name>"`` or ``<name>``) against factor, a line per
    layer set, averaged over prompts; the baseline as a dashed line, a cell no factor changes (an ablation) as a
    dotted one. Returns the matplotlib ``Figure``."""
    column = score if score.startswith("score: ") else f"score: {score}"
    rows = [row for row in table if column in row]
    if not rows:
        raise ValueError(f"plot_sweep_scores: no row has the column {column!r}; sweep with score= to add it")
    steered = [row for row in rows if row["vector"] is not None and vector in (None, row["vector"])]
    figure = _figure_class()(figsize=(6, 4))
    axes = figure.add_subplot()
    lines: dict[tuple, dict[float, list[float]]] = {}
    levels: dict[tuple, list[float]] = {}
    for row in steered:
        at = row["layers"] if isinstance(row["layers"], str) else ", ".join(map(str, row["layers"]))
        if row["factor"] is None:  # a cell no factor changes (an ablation): a level across the factors
            levels.setdefault((row["vector"], at), []).append(row[column])
        else:
            lines.setdefault((row["vector"], at), {}).setdefault(row["factor"], []).append(row[column])
    for (name, at), points in sorted(lines.items()):
        factors = sorted(points)
        means = [sum(points[f]) / len(points[f]) for f in factors]
        axes.plot(factors, means, marker="o", label=f"{name} @ layers {at}")
    for (name, at), values in sorted(levels.items()):
        axes.axhline(sum(values) / len(values), linestyle=":", label=f"{name} @ layers {at}")
    baseline = [row[column] for row in rows if row["vector"] is None]
    if baseline:
        axes.axhline(sum(baseline) / len(baseline), linestyle="--", color="grey", label="unsteered")
    axes.set_xlabel("factor")
    axes.set_ylabel(f"{column} (mean over prompts)")
    axes.legend(fontsize="small")
    if file is not None:
        figure.savefig(file, bbox_inches="tight")
    return figure


def heat_map(
    values: torch.Tensor,
    rows: Sequence[str],
    columns: Sequence[str],
    label: str,
    title: str,
    file: str | Path | None = None,
) -> Any:
    """A heat map of ``values`` (``[rows, columns]``), each cell labelled with its value: rows (e.g. layers) from the
    bottom up, columns (e.g. positions and their tokens) left to right; a diverging colour map centred on zero.
    Saved to ``file`` where given (its suffix names the format). Returns the matplotlib ``Figure``."""
    values = values.detach().float().cpu()
    figure = _figure_class()(figsize=(max(4.0, 0.55 * len(columns) + 2), max(3.0, 0.3 * len(rows) + 1.5)))
    axes = figure.add_subplot()
    reach = float(values.abs().max()) or 1.0
    image = axes.imshow(values, cmap="RdBu_r", vmin=-reach, vmax=reach, aspect="auto", origin="lower")
    for row in range(values.shape[0]):
        for column in range(values.shape[1]):
            dark = abs(float(values[row, column])) > 0.6 * reach
            color = "white" if dark else "black"
            axes.text(
                column, row, f"{float(values[row, column]):.2f}", ha="center", va="center", fontsize=6, color=color
            )
    axes.set_xticks(range(len(columns)), list(columns), fontsize=7)
    axes.set_yticks(range(len(rows)), list(rows), fontsize=7)
    axes.set_xlabel("position")
    axes.set_ylabel("layer")
    axes.set_title(title, fontsize=9)
    figure.colorbar(image, ax=axes, label=label)
    if file is not None:
        figure.savefig(file, bbox_inches="tight")
    return figure
