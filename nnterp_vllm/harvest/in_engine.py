"""The vLLM harvest's in-engine path: the engine keeps the selected values itself, inside its compiled model.

Where every selected value is a stream the engine keeps (`components.names.STATIC_VALUES`), a vLLM harvest of a
checkpoint builds a `SteeredVLLM` keeping exactly those values (`engine_settings`) and runs the shards' rows as
one continuous stream of prefill-only requests (one token sampled, no prefix cache, the blocks up to the deepest
value read; `pipeline`), the engine's core in the harvest's own process unless the caller set vLLM's
``VLLM_ENABLE_V1_MULTIPROCESSING`` (`in_process_by_default`). The worker copies each step's kept rows straight
into the shard's columns, in shared memory, in the harvest's dtype; they never travel one token or one request at
a time through the engine's output queue. A probe's scores (``probes.NAME``) are the engine's own probe reads
(`specs.probes`): its engine is built with a probe column per class of the probes read (``max_probe_columns``),
and each request reads them at the positions it keeps. Other values (the attention interior, the experts' choice,
logits) go through nnsight (`StandardizedVLLM`); the manifest's ``vllm_path`` says which path ran and
``engine_process`` where the engine ran.

This module imports no vLLM until an engine is built.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from ..components.names import (
    BLOCK_ORDER,
    MODULE_OUTPUTS,
    ROOT_VALUES,
    STATIC_BLOCK_VALUES,
    STATIC_ROOT_VALUES,
    STATIC_VALUES,
)
from ..specs.capture import NNSIGHT_PATH, Capture
from ..specs.selection import PROBES, Selection, Selector
from .corpus import Row

#: What the harvest's engine is built with unless the caller says otherwise: no prefix cache (no prompt is
#: seen twice), steps of this many tokens (each kept value holds a buffer row of as many).
ENGINE_DEFAULTS = {"enable_prefix_caching": False, "max_num_batched_tokens": 2048}
#: What makes the harvest's engine keep values only: a harvest steers nothing, so its engine runs no steering
#: operation (unless it reads probes: a probe column per class, `engine_settings`).
CAPTURE_ONLY = {"max_steering_entries": 0, "max_probe_columns": 0}
#: The engine setting that sizes its probe reads.
PROBE_COLUMNS = "max_probe_columns"
#: The setting that makes `run.load_model` build this path's engine.
CAPTURE_VALUES = "capture_values"
#: vLLM's setting for running the engine's core in a process of its own (``1``, its default) or in the caller's.
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


def serves(selectors: list[Selector]) -> bool:
    """Whether the engine keeps every value ``selectors`` name (then a vLLM harvest takes this path)."""
    return all(selector.key in STATIC_VALUES for selector in selectors)


def probe_columns(probes: list[Any]) -> int:
    """The probe columns an engine reads ``probes`` (each a `Probe`) with: one per class."""
    return sum(probe.classes for probe in probes)


def engine_settings(selectors: list[Selector], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments the harvest's engine for ``selectors`` is built with, over the caller's ``kwargs``:
    keeping the values they name, with a probe column per class of the probes they read."""
    kept = [selector.text for selector in selectors if selector.probe is None]
    columns = probe_columns([selector.probe[1] for selector in selectors if selector.probe is not None])
    return {**ENGINE_DEFAULTS, **CAPTURE_ONLY, PROBE_COLUMNS: columns, **kwargs, CAPTURE_VALUES: kept or None}


def probes_at(selections: tuple[Selection, ...], positions: str | list[int]) -> dict[str, Any]:
    """The probes ``selections`` read (`Probe`s by name), each at ``positions`` (as `Probe` takes them)."""
    return {
        selection.probe[0]: dataclasses.replace(selection.probe[1], positions=positions)
        for selection in selections
        if selection.probe is not None
    }


class EngineHarvester:
    """A `SteeredVLLM` keeping the harvest's values, as the harvest uses a model: sizes, tokenizer, config,
    `support`, and each shard's rows computed as one batch.

    Args:
        model: A checkpoint directory (an engine is built and owned: `shutdown` stops it) or a `SteeredVLLM`
            built with ``capture_values`` (used as it is).
        **kwargs: For building the engine: ``capture_values`` and any ``SteeredVLLM`` / ``vllm.LLM`` argument.
    """

    ENGINE = "vllm"
    #: The manifest's ``vllm_path``.
    PATH = "engine"

    def __init__(self, model: Any, **kwargs: Any) -> None:
        from ..engines.steered.engine import SteeredVLLM

        self.owned = not isinstance(model, SteeredVLLM)
        self.chose_in_process = self.owned and in_process_by_default()
        try:
            self.llm = SteeredVLLM(model, **kwargs) if self.owned else model
        except BaseException:
            self._restore_arrangement()
            raise
        model_config = self.llm.vllm_config.model_config
        self.config = model_config.hf_config
        self.tokenizer = self.llm.get_tokenizer()
        self.num_layers = self.llm.num_layers
        self.hidden_size = self.llm.hidden_size
        self.dtype = model_config.dtype
        from ..engines.first_blocks import blocks_to_run

        self.blocks_run = blocks_to_run(self.llm.vllm_config.additional_config, self.num_layers)

    def support(self) -> dict[str, Any]:
        """Each harvest value -> ``None`` where the engine keeps it on every block, ``{layer: reason}`` where on
        some, else the reason (the engine keeps only what it was built to; the rest is nnsight's)."""
        kept = set(self.llm.capture_values)
        missing = f"this engine was built to keep {', '.join(self.llm.capture_values) or 'nothing'}"
        table: dict[str, Any] = {
            key: f"the engine does not keep it: {NNSIGHT_PATH}" for key in (*ROOT_VALUES, *BLOCK_ORDER)
        }
        for key in STATIC_ROOT_VALUES:
            table[key] = None if key in kept else missing
        for key in STATIC_BLOCK_VALUES:
            gaps = {layer: missing for layer in range(self.num_layers) if f"layers.{layer}.{key}" not in kept}
            table[key] = None if not gaps else missing if len(gaps) == self.num_layers else gaps
        return table

    def module_path(self, selection: Selection) -> str | None:
        """The path of the module whose output ``selection`` is (SAELens's column), as `Selection.module_path`."""
        if selection.probe is not None:
            return None
        module, attribute = self.llm.capture_places[selection.name]
        return module if selection.key in MODULE_OUTPUTS and attribute == "output" else None

    def check_probes(self, selections: list[Selection]) -> None:
        """Refuse probes this engine cannot read at once: more classes than its probe columns."""
        columns = probe_columns([selection.probe[1] for selection in selections if selection.probe is not None])
        if columns > self.llm.max_probe_columns:
            raise ValueError(
                f"the probes harvested read {columns} probe columns (one per class); this engine reads at most "
                f"{self.llm.max_probe_columns}: build it with {PROBE_COLUMNS}={columns} or more"
            )

    def values(
        self, rows: list[Row], selections: tuple[Selection, ...], positions: Any, dtype: str
    ) -> list[dict[str, torch.Tensor]]:
        """Each row's selected values, ``[tokens, ...]`` in ``dtype`` (probe scores in float32), in row order, from
        one batch: at the kept positions for ``"last"``, at every position otherwise (a mask is applied by the
        caller)."""
        from vllm import SamplingParams

        kept = "last" if positions == "last" else "all"
        wanted = [selection.name for selection in selections if selection.probe is None]
        capture = Capture(wanted, kept, dtype) if wanted else None
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        prompts = [{"prompt_token_ids": list(row.token_ids)} for row in rows]
        probes = probes_at(selections, kept) or None
        outputs = self.llm.generate(prompts, params, capture=capture, probes=probes, use_tqdm=False)
        return [
            {
                **(output.activations or {}),
                **{PROBES + name: scores for name, scores in (output.probes or {}).items()},
            }
            for output in outputs
        ]

    @property
    def engine_process(self) -> str:
        """Where the engine's core runs: ``"in-process"`` (with the harvest) or ``"own process"`` (vLLM's default)."""
        from vllm.v1.engine.core_client import InprocClient

        return "in-process" if isinstance(self.llm.llm_engine.engine_core, InprocClient) else "own process"

    def shutdown(self) -> None:
        """Stop the engine, if this harvester built it."""
        if self.owned:
            try:
                self.llm.shutdown()
            finally:
                self._restore_arrangement()

    def _restore_arrangement(self) -> None:
        if self.chose_in_process:
            self.chose_in_process = False
            os.environ.pop(MULTIPROCESSING, None)
            from ..engines.vllm_environment import reread_environment

            reread_environment()


def in_process_by_default() -> bool:
    """Run the harvest's own engine in this process, unless the caller chose (``VLLM_ENABLE_V1_MULTIPROCESSING`` set):
    nothing crosses a process boundary then, and on vLLM's CPU build the engine keeps this process's threads (in a
    process of its own it runs one). Whether it did is the manifest's ``engine_process``."""
    if MULTIPROCESSING in os.environ:
        return False
    os.environ[MULTIPROCESSING] = "0"
    from ..engines.vllm_environment import reread_environment

    reread_environment()
    return True


__all__ = [
    "CAPTURE_ONLY",
    "ENGINE_DEFAULTS",
    "EngineHarvester",
    "engine_settings",
    "in_process_by_default",
    "probe_columns",
    "probes_at",
    "serves",
]
