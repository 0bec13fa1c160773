"""Mixture-of-experts decoder families: the keys their tiny checkpoints need.

Four experts, two per token, small expert widths; where a family mixes dense and sparse
blocks, the first block is dense so both kinds are exercised; multipliers and routed
scalings are set away from 1 so a family that forgets one fails.
"""

from typing import Any

MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
#: DeepSeek-style routing: routed experts, a shared expert, a dense first block.
ROUTED = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.0,
}
#: Multi-head latent attention at the tiny sizes; its keys are expanded to every head before the attention call.
LATENT = {
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "num_key_value_heads": 4,
}

OVERRIDES: dict[str, dict[str, Any]] = {
    "mixtral": MOE,
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "mlp_only_layers": [0],
    },
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "mlp_only_layers": [0]},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64},
    "phimoe": MOE,
    "flex_olmo": {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64},
    "hunyuan_v1_moe": {"num_experts": 4, "moe_topk": 2, "intermediate_size": 64},
    "granitemoe": {
        **MOE,
        "intermediate_size": 64,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 4.0,
    },
    "dots1": ROUTED,
    "ernie4_5_moe": {
        "moe_num_experts": 4,
        "moe_k": 2,
        "moe_num_shared_experts": 1,
        "moe_intermediate_size": 64,
        "moe_layer_start_index": 1,
    },
    "glm4_moe": ROUTED,
    "deepseek_v3": {**ROUTED, **LATENT, "n_group": 2, "topk_group": 1},
    "deepseek_v2": {**ROUTED, **LATENT, "topk_method": "greedy"},
    "afmoe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 64,
        "num_dense_layers": 1,
        "route_scale": 2.0,
        "mup_enabled": True,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    "cohere2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "logit_scale": 0.5,
    },
    "jetmoe": {**MOE, "intermediate_size": 64},
    "gpt_oss": {
        **MOE,
        "intermediate_size": 64,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    "dbrx": {
        "d_model": 128,  # set before the sub-configs are built (``hidden_size`` is mapped onto it only afterwards)
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    },
}
