"""One request's numbers stay in its own output: nothing non-finite is written into the KV cache.

vLLM hands a finished request's KV-cache blocks to later requests without clearing them, and an
attention kernel may read a block's slots past a sequence's end (masked: a zero weight, but
``0 * NaN`` is NaN). So a request whose stream turned non-finite (a huge steering vector, a write
through nnsight) left NaN/inf in blocks that poisoned the next requests to get them, whoever sent
them. `keep_kv_cache_finite` makes every attention layer write only finite keys and values: a
non-finite element is stored as 0. Finite values pass unchanged, so every other request computes
exactly what it computed before; the poisoned request keeps its own (non-finite) output.
"""

from __future__ import annotations

from typing import Any

import torch


def finite(value: Any) -> Any:
    """``value`` with NaN and +-inf elements set to 0 where it is a floating tensor; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return torch.nan_to_num(value, nan=0.0, posinf=0.0, neginf=0.0)
    return value


def keep_kv_cache_finite(model: torch.nn.Module) -> int:
    """Make every vLLM attention layer of ``model`` cache only finite keys and values; how many layers.

    A layer's arguments after the query are what it writes into the KV cache (``key``, ``value``; on MLA
    the compressed latent and the rotary key). The wrapper is the layer's own ``forward`` attribute, so
    a call through the module and vLLM's Transformers backend's direct ``layer.forward(...)`` both pass
    through it, and a compiled model traces it into its graph.
    """
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layers = [module for module in model.modules() if isinstance(module, (Attention, MLAAttention))]
    for layer in layers:
        layer.forward = _caching_finite(layer.forward)
    return len(layers)


def _caching_finite(forward: Any) -> Any:
    def forward_caching_finite(query: torch.Tensor, *cached: Any, **kwargs: Any) -> Any:
        return forward(query, *(finite(value) for value in cached), **kwargs)

    return forward_caching_finite
