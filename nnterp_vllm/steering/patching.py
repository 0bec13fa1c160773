"""Activation patching sweeps: which block and position carry what a clean prompt has and a corrupted one lacks.

`patch_sweep(model, clean, corrupt, layers, positions, metric)` runs the clean prompt once, keeping a value of each
block at each position (its ``layer_output`` unless told), then the corrupted prompt once per (block, position)
cell with that one value set to the clean run's (`Patch`), and reads a metric of the next token from each run's
last-position logits (`steering.metrics`: `LogitDiff`, `Logprob`, `Recovered`). On `SteeredVLLM` every cell is a
request of one continuous batch, patched inside the compiled graph, its metric read in the engine's worker (only
the number comes back); a cell patched at position ``p`` shares the corrupted prompt's prefix-cache blocks before
``p``. On `StandardizedTransformer` the same call runs one trace per cell, for parity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import arguments
from .metrics import LogitDiff, Logprob, Recovered, base_metric, metric_value, metric_wire
from .specs import PATCHED_VALUES, Patch

WHAT = "patch_sweep"


@dataclass
class PatchSweep:
    """A patching sweep: the metric of every cell (``values``, ``[len(layers), len(positions)]``: the corrupted
    prompt with block ``layers[i]``'s ``value`` at position ``positions[j]`` set to the clean run's), and the clean
    and corrupted runs' own (``clean``, ``corrupt``). For a `Recovered` metric ``values`` are fractions and the
    baselines 1 and 0; ``measured`` keeps the metric it is the fraction of."""

    metric: str
    value: str
    layers: list[int]
    positions: list[int]
    tokens: list[str]
    values: torch.Tensor
    clean: float
    corrupt: float
    measured: dict[str, Any] = field(default_factory=dict)

    def frame(self) -> Any:
        """The cells as a pandas ``DataFrame``: a row per layer, a column per position (named ``"<position>:
        <token>"``)."""
        import pandas

        columns = [f"{position}: {token}" for position, token in zip(self.positions, self.tokens)]
        return pandas.DataFrame(self.values.tolist(), index=pandas.Index(self.layers, name="layer"), columns=columns)

    def as_dict(self) -> dict[str, Any]:
        """The sweep as plain data (what the server answers)."""
        return {
            "metric": self.metric,
            "value": self.value,
            "layers": self.layers,
            "positions": self.positions,
            "tokens": self.tokens,
            "values": self.values.tolist(),
            "clean": self.clean,
            "corrupt": self.corrupt,
            **({"measured": self.measured} if self.measured else {}),
        }

    def display(self, file: str | Path | None = None, title: str | None = None) -> Any:
        """The ``[layer x position]`` heat map of the metric (matplotlib's ``Figure``; saved to ``file`` where given,
        in the format its suffix names)."""
        from ..display import heat_map

        return heat_map(
            self.values,
            rows=[str(layer) for layer in self.layers],
            columns=[f"{position}\n{token}" for position, token in zip(self.positions, self.tokens)],
            label=self.metric,
            title=title or f"{self.metric} with {self.value} patched from the clean run",
            file=file,
        )


def patch_sweep(
    model: Any,
    clean: str | Sequence[int],
    corrupt: str | Sequence[int],
    layers: Any = None,
    positions: Sequence[int] | None = None,
    metric: LogitDiff | Logprob | Recovered | None = None,
    value: str = "layer_output",
    progress: bool = False,
) -> PatchSweep:
    """Patch ``value`` of each of ``layers`` (every block by default) at each of ``positions`` (every prompt
    position by default; negative counting from the end) from the ``clean`` prompt's run into the ``corrupt``
    prompt's, and measure ``metric`` at the last position of each (`PatchSweep`).

    ``model`` is a `SteeredVLLM` (built to keep those values: ``capture_values=["layers.*.layer_output"]``) or a
    `StandardizedTransformer`. The prompts (text, or token ids) must be as long as each other. Everything is checked
    before any run: ``ValueError`` naming what is wrong.
    """
    if metric is None:
        raise ValueError(f"{WHAT}: give a metric: LogitDiff(correct, wrong), Logprob(token) or Recovered(...)")
    base = base_metric(metric, WHAT)
    if value not in PATCHED_VALUES:
        raise ValueError(f"{WHAT}: value must be one of {', '.join(PATCHED_VALUES)}, got {value!r}")
    on_vllm = hasattr(model, "metric_wires")
    tokenizer = model.get_tokenizer() if on_vllm else model.tokenizer
    clean_ids, corrupt_ids = (
        prompt_ids(prompt, tokenizer, name) for name, prompt in (("clean", clean), ("corrupt", corrupt))
    )
    if len(clean_ids) != len(corrupt_ids):
        raise ValueError(
            f"{WHAT}: the clean prompt is {len(clean_ids)} tokens and the corrupt one {len(corrupt_ids)}: patching "
            "sets a position's value from one into the other, so they must be as long as each other"
        )
    chosen_layers = arguments.layer_indices(
        list(range(model.num_layers)) if layers is None else layers, model.num_layers, WHAT
    )
    chosen = range(len(corrupt_ids)) if positions is None else positions
    chosen_positions = sorted(set(arguments.positions_within(list(chosen), len(corrupt_ids), WHAT)))
    wire = metric_wire(base, tokenizer, vocab_size(model))
    run = on_engine if on_vllm else on_transformers
    clean_value, corrupt_value, values = run(
        model, clean_ids, corrupt_ids, chosen_layers, chosen_positions, value, base, wire, progress
    )
    tokens = [tokenizer.decode([corrupt_ids[position]]) for position in chosen_positions]
    sweep = PatchSweep(base.name, value, chosen_layers, chosen_positions, tokens, values, clean_value, corrupt_value)
    if isinstance(metric, Recovered):
        difference = clean_value - corrupt_value
        if difference == 0:
            raise ValueError(
                f"{WHAT}: the clean and corrupt runs' {base.name} are equal ({clean_value}): nothing to recover"
            )
        sweep.measured = {
            "metric": base.name,
            "values": values.tolist(),
            "clean": clean_value,
            "corrupt": corrupt_value,
        }
        sweep.metric, sweep.values = metric.name, (values - corrupt_value) / difference
        sweep.clean, sweep.corrupt = 1.0, 0.0
    return sweep


def prompt_ids(prompt: Any, tokenizer: Any, name: str) -> list[int]:
    """A prompt (text, or token ids) as token ids, as the engines tokenize it."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    listed = arguments.listed_ints(prompt)
    if listed is None:
        raise ValueError(f"{WHAT}: {name} is a prompt's text or its token ids, got {type(prompt).__name__}")
    return listed


def vocab_size(model: Any) -> int:
    """The model's vocabulary size, on either engine."""
    config = getattr(model, "vllm_config", None)
    return config.model_config.get_vocab_size() if config is not None else model.vocab_size


def on_engine(
    model: Any,
    clean: list[int],
    corrupt: list[int],
    layers: list[int],
    positions: list[int],
    value: str,
    base: Any,
    wire: dict[str, Any],
    progress: bool,
) -> tuple[float, float, torch.Tensor]:
    """The sweep on a `SteeredVLLM`: the clean run keeping the values (and both runs' metric), then every cell in one
    batch, its metric read in the worker."""
    from vllm import SamplingParams

    from ..capture import Capture

    names = [f"layers.{layer}.{value}" for layer in layers]
    missing = [name for name in names if name not in model.capture_values]
    if missing:
        raise ValueError(
            f"{WHAT}: the clean run's {', '.join(missing)} are read by capture, and this engine keeps none of them: "
            f"build it with capture_values=['layers.*.{value}'] (it keeps {model.capture_values or 'nothing'})"
        )
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prompts = [{"prompt_token_ids": clean}, {"prompt_token_ids": corrupt}]
    runs = model.generate(prompts, params, capture=[Capture(names, positions), None], metric=base, use_tqdm=False)
    kept = runs[0].activations
    cells = [
        [Patch(kept[name][index], layers=layer, positions=[position], value=value)]
        for layer, name in zip(layers, names)
        for index, position in enumerate(positions)
    ]
    patched = model.generate([prompts[1]] * len(cells), params, cells, metric=base, use_tqdm=progress)
    values = torch.tensor([output.metric for output in patched], dtype=torch.float32).view(len(layers), len(positions))
    return runs[0].metric, runs[1].metric, values


def on_transformers(
    model: Any,
    clean: list[int],
    corrupt: list[int],
    layers: list[int],
    positions: list[int],
    value: str,
    base: Any,
    wire: dict[str, Any],
    progress: bool,
) -> tuple[float, float, torch.Tensor]:
    """The sweep on a `StandardizedTransformer`: one trace keeping the clean values, one per cell."""
    with model.trace(torch.tensor([clean])):
        kept = [getattr(model.layers[layer], value)[0, positions].save() for layer in layers]
        clean_logits = model.logits[0, -1].save()
    with model.trace(torch.tensor([corrupt])):
        corrupt_logits = model.logits[0, -1].save()
    values = torch.empty(len(layers), len(positions))
    for i, layer in enumerate(layers):
        for j, position in enumerate(positions):
            with model.trace(torch.tensor([corrupt])):
                model.patch(layer, kept[i][j], [position], value=value)
                logits = model.logits[0, -1].save()
            values[i, j] = metric_value(logits, wire)
    return float(metric_value(clean_logits, wire)), float(metric_value(corrupt_logits, wire)), values


__all__ = ["PatchSweep", "patch_sweep"]
