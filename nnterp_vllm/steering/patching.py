"""Activation patching sweeps: which block and position carry what a clean prompt has and a corrupted one lacks.

`patch_sweep(model, clean, corrupt, layers, positions, metric)` runs the clean prompt once, keeping a value of each
block at each position (its ``layer_output`` unless told), then the corrupted prompt once per (block, position)
cell with that one value set to the clean run's (`Patch`), and reads a metric of the next token from each run's
last-position logits (`specs.metrics`: `LogitDiff`, `Logprob`, `Recovered`). On `SteeredVLLM` every cell is a
request of one continuous batch, patched inside the compiled graph, its metric read in the engine's worker (only
the number comes back); a cell patched at position ``p`` shares the corrupted prompt's prefix-cache blocks before
``p``. On `StandardizedTransformer` the same call runs one trace per cell, for parity.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import arguments
from ..specs.metrics import (
    LogitDiff,
    Logprob,
    Recovered,
    base_metric,
    metric_value,
    metric_wire,
)
from ..specs.patch import PATCHED_VALUES, Patch

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
    planned = Planned.of(model, clean, corrupt, layers, positions, metric, value)
    if not hasattr(model, "metric_wires"):
        return planned.result(*on_transformers(model, planned))
    steps = planned.engine_steps(model)
    batch = next(steps)
    try:
        while True:
            prompts, params, steering, capture, measure = batch
            shown = progress and len(prompts) > 2
            outputs = model.generate(prompts, params, steering, capture=capture, metric=measure, use_tqdm=shown)
            batch = steps.send(outputs)
    except StopIteration as done:
        return planned.result(*done.value)


async def served_patch_sweep(
    engine: Any,
    clean: str | Sequence[int],
    corrupt: str | Sequence[int],
    layers: Any = None,
    positions: Sequence[int] | None = None,
    metric: LogitDiff | Logprob | Recovered | None = None,
    value: str = "layer_output",
) -> PatchSweep:
    """`patch_sweep` on an `AsyncSteeredVLLM` (the server's engine): every cell a request of its continuous batch."""
    import asyncio
    import uuid

    planned = Planned.of(engine, clean, corrupt, layers, positions, metric, value)
    steps = planned.engine_steps(engine)

    async def last(prompt: Any, params: Any, steering: Any, capture: Any, measure: Any) -> Any:
        request_id = f"patch-sweep-{uuid.uuid4().hex}"
        running = engine.generate(prompt, params, request_id, steering=steering, capture=capture, metric=measure)
        return [output async for output in running][-1]

    batch = next(steps)
    try:
        while True:
            prompts, params, steering, capture, measure = batch
            runs = zip(prompts, steering, capture or [None] * len(prompts))
            outputs = await asyncio.gather(*(last(p, params, s, c, measure) for p, s, c in runs))
            batch = steps.send(list(outputs))
    except StopIteration as done:
        return planned.result(*done.value)


@dataclass
class Planned:
    """A sweep checked against its model: the prompts' ids, the layers and positions, the metric and its engine
    form."""

    clean: list[int]
    corrupt: list[int]
    layers: list[int]
    positions: list[int]
    value: str
    metric: Any
    base: Any
    wire: dict[str, Any]
    tokens: list[str]

    @classmethod
    def of(cls, model: Any, clean: Any, corrupt: Any, layers: Any, positions: Any, metric: Any, value: str) -> Planned:
        """Check a sweep's arguments against ``model`` (either engine); ``ValueError`` naming what is wrong."""
        if metric is None:
            raise ValueError(f"{WHAT}: give a metric: LogitDiff(correct, wrong), Logprob(token) or Recovered(...)")
        base = base_metric(metric, WHAT)
        if value not in PATCHED_VALUES:
            raise ValueError(f"{WHAT}: value must be one of {', '.join(PATCHED_VALUES)}, got {value!r}")
        tokenizer = model.get_tokenizer() if hasattr(model, "metric_wires") else model.tokenizer
        clean_ids, corrupt_ids = (
            prompt_ids(prompt, tokenizer, name) for name, prompt in (("clean", clean), ("corrupt", corrupt))
        )
        if len(clean_ids) != len(corrupt_ids):
            raise ValueError(
                f"{WHAT}: the clean prompt is {len(clean_ids)} tokens and the corrupt one {len(corrupt_ids)}: patching "
                "sets a position's value from one into the other, so they must be as long as each other"
            )
        every = list(range(model.num_layers)) if layers is None else layers
        chosen_layers = arguments.layer_indices(every, model.num_layers, WHAT)
        chosen = range(len(corrupt_ids)) if positions is None else positions
        chosen_positions = sorted(set(arguments.positions_within(list(chosen), len(corrupt_ids), WHAT)))
        wire = metric_wire(base, tokenizer, vocab_size(model))
        tokens = [tokenizer.decode([corrupt_ids[position]]) for position in chosen_positions]
        return cls(clean_ids, corrupt_ids, chosen_layers, chosen_positions, value, metric, base, wire, tokens)

    def engine_steps(self, model: Any) -> Generator[tuple, list[Any], tuple[float, float, torch.Tensor]]:
        """The sweep on a steered engine, as batches of requests (``(prompts, params, steering, capture, metric)``,
        each answered with their outputs): the clean and corrupt runs (the clean one keeping the values), then every
        cell, each patched with its clean value; returns the clean and corrupt metrics and the cells'."""
        from vllm import SamplingParams

        from ..specs.capture import Capture

        names = [f"layers.{layer}.{self.value}" for layer in self.layers]
        missing = [name for name in names if name not in model.capture_values]
        if missing:
            raise ValueError(
                f"{WHAT}: the clean run's {', '.join(missing)} are read by capture, and this engine keeps none of "
                f"them: build it with capture_values=['layers.*.{self.value}'] (it keeps "
                f"{model.capture_values or 'nothing'})"
            )
        params = SamplingParams(max_tokens=1, temperature=0.0)
        prompts = [{"prompt_token_ids": self.clean}, {"prompt_token_ids": self.corrupt}]
        runs = yield prompts, params, [None, None], [Capture(names, self.positions), None], self.base
        kept = runs[0].activations
        cells = [
            [Patch(kept[name][index], layers=layer, positions=[position], value=self.value)]
            for layer, name in zip(self.layers, names)
            for index, position in enumerate(self.positions)
        ]
        patched = yield [prompts[1]] * len(cells), params, cells, None, self.base
        values = [output.metric for output in patched]
        shape = (len(self.layers), len(self.positions))
        return runs[0].metric, runs[1].metric, torch.tensor(values, dtype=torch.float32).view(shape)

    def result(self, clean: float, corrupt: float, values: torch.Tensor) -> PatchSweep:
        """The sweep's table from the runs' metrics (a `Recovered` metric's fractions where asked)."""
        sweep = PatchSweep(self.base.name, self.value, self.layers, self.positions, self.tokens, values, clean, corrupt)
        if isinstance(self.metric, Recovered):
            difference = clean - corrupt
            if difference == 0:
                raise ValueError(
                    f"{WHAT}: the clean and corrupt runs' {self.base.name} are equal ({clean}): nothing to recover"
                )
            sweep.measured = {"metric": self.base.name, "values": values.tolist(), "clean": clean, "corrupt": corrupt}
            sweep.metric, sweep.values = self.metric.name, (values - corrupt) / difference
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


def on_transformers(model: Any, planned: Planned) -> tuple[float, float, torch.Tensor]:
    """The sweep on a `StandardizedTransformer`: one trace keeping the clean values, one per cell."""
    value, positions, wire = planned.value, planned.positions, planned.wire
    with model.trace(torch.tensor([planned.clean])):
        kept = [getattr(model.layers[layer], value)[0, positions].save() for layer in planned.layers]
        clean_logits = model.logits[0, -1].save()
    with model.trace(torch.tensor([planned.corrupt])):
        corrupt_logits = model.logits[0, -1].save()
    values = torch.empty(len(planned.layers), len(positions))
    for i, layer in enumerate(planned.layers):
        for j, position in enumerate(positions):
            with model.trace(torch.tensor([planned.corrupt])):
                model.patch(layer, kept[i][j], [position], value=value)
                logits = model.logits[0, -1].save()
            values[i, j] = metric_value(logits, wire)
    return float(metric_value(clean_logits, wire)), float(metric_value(corrupt_logits, wire)), values


__all__ = ["PatchSweep", "patch_sweep", "served_patch_sweep"]
