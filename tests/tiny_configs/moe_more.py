"""More mixture-of-experts decoder families: the keys their tiny checkpoints need.

Four experts, two per token, small expert widths; the first block is dense where the family
mixes dense and sparse blocks, sliding and full attention both present where the family mixes
them; multipliers and routed scalings are set away from 1 so a family that forgets one fails.
"""

from typing import Any

SPARSE_AFTER_DENSE = ["dense", "sparse", "sparse"]
SLIDING_FULL = ["sliding_attention", "full_attention", "sliding_attention"]
#: DeepSeek-style routing over grouped experts (the expert count is spelled per family).
ROUTING = {
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.0,
}
GROUPED = {"n_routed_experts": 4, **ROUTING}
#: Multi-head latent attention at head_dim 32.
LATENT = {"q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32}
#: Granite's experts beside a shared MLP, its multipliers away from 1.
GRANITE_SHARED = {
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 64,
    "shared_intermediate_size": 64,
    "embedding_multiplier": 2.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.2,
    "logits_scaling": 4.0,
}

OVERRIDES: dict[str, dict[str, Any]] = {
    "mellum": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "sliding_window": 16,
        "layer_types": SLIDING_FULL,
        "mlp_layer_types": SPARSE_AFTER_DENSE,
    },
    "minimax_m2": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64},
    "solar_open": {**GROUPED, "n_shared_experts": 1},
    "exaone_moe": {
        **ROUTING,
        "num_experts": 4,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "sliding_window": 16,
        "sliding_window_pattern": 2,
    },
    "axk1": {**GROUPED, **LATENT, "n_shared_experts": 1, "first_k_dense_replace": 1, "num_key_value_heads": 4},
    "mimo_v2_flash": {
        **GROUPED,
        "sliding_window": 16,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        "mlp_layer_types": SPARSE_AFTER_DENSE,
        "v_head_dim": 16,
        "attention_value_scale": 0.5,
    },
    "laguna": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "sliding_window": 16,
        "layer_types": SLIDING_FULL,
        "num_attention_heads_per_layer": [4, 8, 4],
        "moe_routed_scaling_factor": 2.0,
        "moe_router_logit_softcapping": 5.0,
    },
    "zaya": {
        "num_experts": 4,
        "num_experts_per_tok": 1,  # the only top-k the model supports
        "moe_intermediate_size": 64,
        "router_hidden_size": 32,
        "sliding_window": 16,
        "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
        "lm_head_bias": True,
    },
    "hy_v3": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 64,
        "router_scaling_factor": 2.0,
    },
    "granitemoeshared": GRANITE_SHARED,
    "granitemoe_swa": {
        **GRANITE_SHARED,
        "sliding_window": 16,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
        "layer_rope_theta": [0, 10000.0, 20000.0],  # no rotary positions on the first block
    },
    "axk2": {
        **GROUPED,
        **LATENT,
        "n_shared_experts": 1,
        "mlp_layer_types": SPARSE_AFTER_DENSE,
        "num_key_value_heads": 4,
        "index_head_dim": 64,
        "index_n_heads": 2,
        "gated_norm_rank": 8,
    },
    "hy_v4": {
        **GROUPED,
        **LATENT,
        "n_shared_experts": 1,
        "index_head_dim": 64,
        "index_n_heads": 2,
        "hc_mult": 2,
        "learnable_sink_init": 0.5,
    },
}
