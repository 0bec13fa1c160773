"""The vLLM harvest's in-engine path: the engine keeps the selected values itself, inside its compiled model.

Where every selected value is a stream the engine keeps (`capture.STATIC_VALUES`), a vLLM harvest of a
checkpoint builds a `SteeredVLLM` keeping exactly those values (`engine_settings`) and runs each shard's rows
as one continuous batch of prefill-only requests (one token sampled, no prefix cache, the blocks up to the
deepest value read). The worker copies each step's kept rows straight into each request's tensors, in the
harvest's dtype; those tensors are the parts the shard writer writes (`run.compute`), handed over once per
shard (in-process, by reference), never one token or one request at a time through the engine's output
queue. Other values (the attention interior, the experts' choice, logits) go through nnsight
(`StandardizedVLLM`); the manifest's ``vllm_path`` says which path ran.

This module imports no vLLM until an engine is built.
"""

from __future__ import annotations

from typing import Any

import torch

from ..capture import NNSIGHT_PATH, STATIC_BLOCK_VALUES, STATIC_ROOT_VALUES, STATIC_VALUES, Capture
from .corpus import Row
from .selection import BLOCK_ORDER, MODULE_OUTPUTS, ROOT_VALUES, Selection, Selector

#: What the harvest's engine is built with unless the caller says otherwise: no prefix cache (no prompt is
#: seen twice), steps of this many tokens (each kept value holds a buffer row of as many).
ENGINE_DEFAULTS = {"enable_prefix_caching": False, "max_num_batched_tokens": 2048}
#: The setting that makes `run.load_model` build this path's engine.
CAPTURE_VALUES = "capture_values"


def serves(selectors: list[Selector]) -> bool:
    """Whether the engine keeps every value ``selectors`` name (then a vLLM harvest takes this path)."""
    return all(selector.key in STATIC_VALUES for selector in selectors)


def engine_settings(selectors: list[Selector], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments the harvest's engine for ``selectors`` is built with, over the caller's ``kwargs``."""
    return {**ENGINE_DEFAULTS, **kwargs, CAPTURE_VALUES: [selector.text for selector in selectors]}


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
        from ..engines.steered import SteeredVLLM

        self.owned = not isinstance(model, SteeredVLLM)
        self.llm = SteeredVLLM(model, **kwargs) if self.owned else model
        model_config = self.llm.vllm_config.model_config
        self.config = model_config.hf_config
        self.tokenizer = self.llm.get_tokenizer()
        self.num_layers = self.llm.num_layers
        self.hidden_size = self.llm.hidden_size
        self.dtype = model_config.dtype
        from ..engines.vllm_platform import blocks_to_run

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
        module, attribute = self.llm.capture_places[selection.name]
        return module if selection.key in MODULE_OUTPUTS and attribute == "output" else None

    def values(
        self, rows: list[Row], selections: tuple[Selection, ...], positions: Any, dtype: str
    ) -> list[dict[str, torch.Tensor]]:
        """Each row's selected values, ``[tokens, ...]`` in ``dtype``, in row order, from one batch: at the kept
        positions for ``"last"``, at every position otherwise (a mask is applied by the caller)."""
        from vllm import SamplingParams

        capture = Capture([selection.name for selection in selections], "last" if positions == "last" else "all", dtype)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        prompts = [{"prompt_token_ids": list(row.token_ids)} for row in rows]
        outputs = self.llm.generate(prompts, params, capture=capture, use_tqdm=False)
        return [output.activations for output in outputs]

    def shutdown(self) -> None:
        """Stop the engine, if this harvester built it."""
        if self.owned:
            self.llm.shutdown()


__all__ = ["ENGINE_DEFAULTS", "EngineHarvester", "engine_settings", "serves"]
