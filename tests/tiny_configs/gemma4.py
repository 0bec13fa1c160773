"""Gemma-4 text and CPM-Ant: the keys their tiny checkpoints need.

Gemma-4 mixes sliding and full attention (the full layers with a wider head, keys doubling
as values, and the last layer reading the keys and values of the one before), adds a
per-layer-input branch and a mixture-of-experts branch beside the dense MLP, and soft-caps
its logits. CPM-Ant spells its widths ``dim_head`` and ``dim_ff``.
"""

from typing import Any

#: Sliding, full, full: the last layer shares the keys and values of the full layer before it.
GEMMA4_LAYERS = {
    "head_dim": 32,
    "global_head_dim": 64,
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention", "full_attention"],
    "num_kv_shared_layers": 1,
    "attention_k_eq_v": True,
    "final_logit_softcapping": 5.0,
}

OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma4_text": {
        **GEMMA4_LAYERS,
        "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": 512,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 64,
    },
    "gemma4_unified_text": GEMMA4_LAYERS,
}
