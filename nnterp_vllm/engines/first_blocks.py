"""Engines that run only the first blocks of their model (a harvest that reads nothing deeper)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FIRST_BLOCKS", "blocks_to_run", "run_first_blocks"]

#: ``additional_config`` key: build only the first N blocks of the model (a harvest that reads nothing deeper).
FIRST_BLOCKS = "nnterp_vllm_first_blocks"


def run_first_blocks(model: torch.nn.Module, vllm_config: Any) -> None:
    """Where ``additional_config[FIRST_BLOCKS]`` is N: make the loaded ``model``'s forward stop after its first
    N blocks. vLLM's model code runs the blocks ``start_layer`` to ``end_layer`` of its block stack (the
    pipeline-parallel range); this lowers ``end_layer``, so every module, weight and config value stays the
    checkpoint's (nnsight on the worker finds the module tree the client has) and the later blocks never
    run. Values after the blocks (the final norm, the logits) are then those of the cut model: only a reader
    of earlier values asks for this. A model whose code has no such range (vLLM's Transformers backend)
    runs every block."""
    total = vllm_config.model_config.get_total_num_hidden_layers()
    blocks = blocks_to_run(vllm_config.additional_config, total)
    if blocks == total:
        return
    for module in model.modules():
        if getattr(module, "start_layer", None) == 0 and getattr(module, "end_layer", None) == total:
            module.end_layer = blocks


def blocks_to_run(additional_config: Any, total: int) -> int:
    """How many of a model's ``total`` blocks each forward runs when built with ``additional_config``
    (`run_first_blocks`): ``additional_config[FIRST_BLOCKS]``, at least one, or every block where unset."""
    first = (additional_config or {}).get(FIRST_BLOCKS)
    return total if not first else min(total, max(1, int(first)))
