"""`sweep`: a steering experiment's whole grid (vectors x layers x factors x prompts) as one batch on `SteeredVLLM`.

Each cell is a request steered by one vector at some layers with one factor (or by specs of any kind, scaled by
the factor: a cap's bounds, a clamp's value; an ablation once); each prompt's unsteered baseline runs once. With
``score``, each cell also asks for the summed log-probability of each target continuation after the prompt (the
A/B-answer scoring of contrastive activation addition's evaluations): a request of the prompt followed by the
target, steered where the cell's steering would act had the model generated the target
itself, whose prompt log-probabilities give it, in the same batch. The result is a `SweepTable`: a list of
rows, a pandas ``DataFrame`` (``.frame``) where pandas is installed, and ``.to_jsonl``;
`display.plot_sweep_scores` draws a score against the factor, a line per layer set (an ablation's a level).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import arguments
from ..specs.steering import EVERYWHERE, Ablate, Steering
from ..specs.steering_requests import KINDS, SPECS, kind_fields
from .sources import load_steering

WHAT = "sweep"
#: The columns every row has, before one per score.
COLUMNS = ("prompt", "vector", "layers", "factor", "text", "token_ids")


class SweepTable(list):
    """The rows of a sweep (dicts with `COLUMNS` and ``score: <name>`` columns), in grid order."""

    @property
    def frame(self) -> Any:
        """The rows as a pandas ``DataFrame`` (``None`` without pandas)."""
        try:
            import pandas
        except ImportError:
            return None
        return pandas.DataFrame(list(self))

    def to_jsonl(self, path: str | Path) -> Path:
        """Write one JSON object per row to ``path``; return it."""
        path = Path(path)
        path.write_text("".join(json.dumps(row) + "\n" for row in self))
        return path


def grid_specs(
    vectors: Mapping[str, Any], layers: Sequence[Any], factors: Sequence[float], positions: Any
) -> list[tuple[str, Any, float | None, list[Any]]]:
    """The grid's cells: ``(vector name, layers, factor, specs)``. A vector given as a ``[hidden]`` tensor (or list
    of floats) is added at each entry of ``layers`` (a block or a list of blocks) times each factor. One given as
    specs (a `Steering`, `Cap`, `Ablate` or `Clamp`, or a list of them, e.g. `load_steering`'s one per layer) is
    applied at its own layers, each spec `scaled` by each factor: a `Steering`'s factor, a `Cap`'s bounds, a
    `Clamp`'s value or scale. Specs no factor changes (`Ablate`s only) make one cell, its factor ``None``."""
    if not isinstance(vectors, Mapping) or not vectors:
        raise ValueError(f"{WHAT}: vectors must be a non-empty dict from names to vectors or lists of specs")
    if isinstance(factors, (str, bytes)) or not isinstance(factors, Sequence) or not factors:
        raise ValueError(f"{WHAT}: factors must be a non-empty list of numbers, got {factors!r}")
    factors = [arguments.finite_number(factor, WHAT) for factor in factors]
    cells = []
    for name, vector in vectors.items():
        if not isinstance(name, str):
            raise ValueError(f"{WHAT}: vector names are strings, got {name!r}")
        loaded = [vector] if isinstance(vector, SPECS) else vector
        if isinstance(loaded, list) and loaded and all(isinstance(spec, SPECS) for spec in loaded):
            placed = [spec.at_positions(positions) for spec in loaded]
            at = spec_layers(placed)
            if all(isinstance(spec, Ablate) for spec in placed):
                cells.append((name, at, None, placed))
                continue
            for factor in factors:
                cells.append((name, at, factor, [spec.scaled(factor) for spec in placed]))
            continue
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
            raise ValueError(f"{WHAT}: layers must be a non-empty list of blocks (or lists of blocks), got {layers!r}")
        for entry in layers:
            chosen = arguments.layer_list(entry, WHAT)
            for factor in factors:
                cells.append((name, chosen, factor, [Steering(chosen, vector, factor, positions)]))
    return cells


def spec_layers(specs: Sequence[Any]) -> list[int] | str:
    """The blocks ``specs`` act at, sorted; `EVERYWHERE` where one of them acts at every location."""
    if any(spec.layers == EVERYWHERE for spec in specs):
        return EVERYWHERE
    return sorted({layer for spec in specs for layer in spec.layers})


def scoring_positions(positions: Any, prompt_length: int, target_length: int) -> Any:
    """Where a cell steering at ``positions`` steers the request that scores a target of ``target_length`` tokens
    after a prompt of ``prompt_length``: as if the model had generated the target, whose tokens are then fed
    back in (``"generated"`` becomes the target's positions)."""
    if positions == "generated":
        return list(range(prompt_length, prompt_length + target_length))
    if positions == "prompt":
        return list(range(prompt_length))
    return positions


def sweep(
    model: Any,
    prompts: Sequence[str],
    vectors: Mapping[str, Any],
    layers: Sequence[Any],
    factors: Sequence[float],
    sampling_params: Any = None,
    score: Mapping[str, str] | Sequence[str] | None = None,
    *,
    positions: Any = "all",
    progress: bool = True,
) -> SweepTable:
    """Run the grid ``vectors x layers x factors`` over ``prompts`` on ``model`` (a `SteeredVLLM`) in one batch.

    Args:
        model: The engine.
        prompts: Texts.
        vectors: Name -> a ``[hidden_size]`` vector (added at each of ``layers``), or specs (a `Steering`, `Cap`,
            `Ablate` or `Clamp`, or a list of them, such as `load_steering`'s) applied at their own layers, each
            `scaled` by each factor (a cap's bounds, a clamp's value or scale); ablations alone make one cell.
        layers: Blocks, or lists of blocks steered together, for the plain vectors.
        factors: What each vector (each spec's factor, bounds, value or scale) is multiplied by.
        sampling_params: vLLM ``SamplingParams`` for every generation (vLLM's defaults when ``None``).
        score: Target continuations, a dict name -> text or a list of texts (named by themselves): each row gets
            ``score: <name>``, the summed log-probability of the target's tokens after the prompt under the row's
            steering.
        positions: Where each vector acts (`Steering`'s positions): ``"generated"`` steers the answer only.
        progress: Show vLLM's progress bar over the batch.

    Returns the `SweepTable`: per prompt its baseline (``vector`` ``None``, ``factor`` 0), then each cell.
    Everything is checked before any request reaches the engine.
    """
    from vllm import SamplingParams

    if isinstance(prompts, str) or not prompts or not all(isinstance(prompt, str) and prompt for prompt in prompts):
        raise ValueError(f"{WHAT}: prompts must be a non-empty list of non-empty texts")
    targets = dict(zip(score, score)) if isinstance(score, Sequence) and not isinstance(score, str) else score
    if targets is not None and (
        not isinstance(targets, Mapping) or not targets or not all(isinstance(t, str) and t for t in targets.values())
    ):
        raise ValueError(f"{WHAT}: score must be a non-empty dict of names to target texts, or a list of texts")
    cells = [(None, None, 0.0, None), *grid_specs(vectors, layers, factors, positions)]
    generation = sampling_params or model.get_default_sampling_params()
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    tokenizer = model.get_tokenizer()
    requests, plan = [], []
    for prompt in prompts:
        prompt_ids = tokenizer(prompt)["input_ids"]
        for name, at, factor, specs in cells:
            row = {"prompt": prompt, "vector": name, "layers": at, "factor": factor}
            plan.append(("generate", row, None))
            requests.append(({"prompt_token_ids": prompt_ids}, generation, specs))
            for label, target in (targets or {}).items():
                target_ids = tokenizer(target, add_special_tokens=False)["input_ids"]
                placed = None
                if specs is not None:
                    where = scoring_positions(positions, len(prompt_ids), len(target_ids))
                    placed = [spec.at_positions(where) for spec in specs]
                plan.append(("score", row, (label, len(target_ids))))
                requests.append(({"prompt_token_ids": prompt_ids + target_ids}, scoring, placed))
    if positions == "generated" and model.llm_engine.vllm_config.cache_config.enable_prefix_caching:
        # Requests the engine admits in one step all miss the prefix cache: each prompt's blocks are
        # computed first, once, so that every cell (and the baseline) reads them.
        distinct = {tuple(prompt["prompt_token_ids"]) for prompt, params, _ in requests if params is generation}
        warm = SamplingParams(max_tokens=1, detokenize=False)
        model.generate([{"prompt_token_ids": list(ids)} for ids in distinct], warm, use_tqdm=False)
    outputs = model.generate(
        [prompt for prompt, _, _ in requests],
        [params for _, params, _ in requests],
        [specs for _, _, specs in requests],
        use_tqdm=progress,
    )
    table = SweepTable()
    for (kind, row, scored), output in zip(plan, outputs):
        if kind == "generate":
            completion = output.outputs[0]
            row.update(text=completion.text, token_ids=list(completion.token_ids))
            table.append(row)
        else:
            label, count = scored
            row[f"score: {label}"] = target_logprob(output, count)
    return table


def target_logprob(output: Any, count: int) -> float:
    """The summed log-probability of the last ``count`` prompt tokens of a request with ``prompt_logprobs``."""
    ids, logprobs = output.prompt_token_ids, output.prompt_logprobs
    total = sum(logprobs[position][ids[position]].logprob for position in range(len(ids) - count, len(ids)))
    return total if math.isfinite(total) else float("-inf")


#: What a grid file (YAML or JSON) may hold.
GRID_KEYS = ("prompts", "vectors", "layers", "factors", "positions", "sampling", "score", "engine")


def read_grid(path: str | Path) -> dict[str, Any]:
    """A sweep's grid from a YAML (``.yaml``/``.yml``) or JSON file: ``prompts``, ``vectors`` (name -> a list of
    floats, a vector file `load_steering` reads, ``{path, feature, layers}``, or a spec ``{kind, ...}``:
    `specs.KINDS`), ``layers``, ``factors``, and
    optionally ``positions``, ``sampling`` (``SamplingParams`` arguments), ``score`` and ``engine`` (arguments of
    `SteeredVLLM`). ValueError naming the file and the key for anything else."""
    path = Path(path)
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            grid = yaml.safe_load(text)
        else:
            grid = json.loads(text)
    except ValueError as error:  # json's and yaml's errors are ValueErrors
        kind = "YAML" if path.suffix in (".yaml", ".yml") else "JSON"
        raise ValueError(f"{path} is not valid {kind}: {error}") from None
    if not isinstance(grid, dict):
        raise ValueError(f"{path}: a grid is a mapping of {', '.join(GRID_KEYS)}")
    unknown = sorted(set(grid) - set(GRID_KEYS))
    missing = [key for key in ("prompts", "vectors", "factors") if key not in grid]
    if unknown or missing:
        raise ValueError(
            f"{path}: unknown keys {unknown} / missing keys {missing}; a grid holds {', '.join(GRID_KEYS)}"
        )
    grid["vectors"] = {name: grid_vector(path, name, entry) for name, entry in dict(grid["vectors"]).items()}
    return grid


def grid_vector(path: Path, name: str, entry: Any) -> Any:
    """One ``vectors`` entry of a grid file: a list of floats, the vector file it names (relative to the grid), or
    a spec by its ``kind`` (`specs.KINDS`; a clamp's ``sae`` a SAELens directory relative to the grid)."""
    if isinstance(entry, list):
        return entry
    options = dict(entry) if isinstance(entry, dict) else {"path": entry}
    if "kind" in options:
        return grid_spec(path, name, options)
    if not isinstance(options.get("path"), str):
        raise ValueError(f"{path}: vectors.{name} is a list of floats, a file path, or {{path, feature, layers}}")
    source = path.parent / options.pop("path")
    return load_steering(source, **options)


def grid_spec(path: Path, name: str, options: dict[str, Any]) -> Any:
    """A grid file's ``vectors`` entry that names its ``kind``, as that kind's spec; ValueError naming the entry."""
    kind = options.pop("kind")
    if kind not in KINDS:
        raise ValueError(f"{path}: vectors.{name}.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    spec, fields = KINDS[kind][0], kind_fields(kind)
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"{path}: vectors.{name} (kind {kind!r}) takes {', '.join(fields)}, not {unknown}")
    if isinstance(options.get("sae"), str):
        options["sae"] = path.parent / options["sae"]
    try:
        return spec(**options)
    except (TypeError, ValueError, OSError) as error:
        raise ValueError(f"{path}: vectors.{name}: {error}") from None


def run_grid(model: str | Path, grid: dict[str, Any], progress: bool = True) -> SweepTable:
    """Build `SteeredVLLM` for ``model`` (with the grid's ``engine`` arguments) and sweep the grid on it."""
    from vllm import SamplingParams

    from ..engines.steered.engine import SteeredVLLM

    sampling = SamplingParams(**grid.get("sampling", {}))
    llm = SteeredVLLM(model, **grid.get("engine", {}))
    try:
        return sweep(
            llm,
            grid["prompts"],
            grid["vectors"],
            grid.get("layers", []),
            grid["factors"],
            sampling,
            grid.get("score"),
            positions=grid.get("positions", "all"),
            progress=progress,
        )
    finally:
        llm.shutdown()


__all__ = ["COLUMNS", "SweepTable", "grid_specs", "read_grid", "run_grid", "sweep"]
