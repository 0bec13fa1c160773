"""Hybrid decoder families (linear attention, gated delta nets, short convolutions, recurrences): their tiny keys.

Three blocks that mix both token-mixer kinds (softmax attention first, where transformers'
``output_attentions`` lists it at index 0, then two recurrent or convolutional mixers) where a family
mixes them; small linear-attention heads; four experts, two per token, with small widths where the MLP
is sparse (a dense first block where the family mixes both); residual factors and scalings away from 1.
"""

from typing import Any

#: Gated-delta-net heads that fit the tiny width.
DELTA_NET = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
}
FULL_LINEAR_LINEAR = ["full_attention", "linear_attention", "linear_attention"]
QWEN_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}

OVERRIDES: dict[str, dict[str, Any]] = {
    # The MLP width is auto-adjusted from intermediate_size (2/3, rounded up to block_multiple_of): 192.
    "lfm2": {"layer_types": ["full_attention", "conv", "conv"], "block_multiple_of": 32},
    "lfm2_moe": {
        "layer_types": ["full_attention", "conv", "conv"],
        "num_dense_layers": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "routed_scaling_factor": 2.0,
    },
    "qwen3_next": {
        **DELTA_NET,
        **QWEN_MOE,
        "layer_types": FULL_LINEAR_LINEAR,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [0],
    },
    "qwen3_5_text": {**DELTA_NET, "layer_types": FULL_LINEAR_LINEAR},
    "qwen3_5_moe_text": {
        **DELTA_NET,
        **QWEN_MOE,
        "layer_types": FULL_LINEAR_LINEAR,
        "shared_expert_intermediate_size": 64,
    },
    "qwen4_exp_text": {
        **DELTA_NET,
        **QWEN_MOE,
        "layer_types": ["indexed_attention", "linear_attention", "linear_attention"],
        "shared_expert_intermediate_size": 64,
        "hc_lowrank": 16,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 32,
        "indexer_budget": 64,
        "indexer_compress_ratio": 4,
        "ple_layer_ids": [3],  # the last block adds a per-layer n-gram embedding
        "ple_embed_dim": 64,
        "heads_per_ngram": 2,
        "ngram_vocab_size_base": 256,
    },
    "olmo_hybrid": {**DELTA_NET, "layer_types": FULL_LINEAR_LINEAR},
    "kimi_linear": {
        "layer_types": FULL_LINEAR_LINEAR,
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "linear_num_heads": 4,
        "linear_head_dim": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "routed_scaling_factor": 2.0,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 32,
        "num_key_value_heads": 4,  # its keys are expanded to every head before the attention call
    },
    "minimax": {
        "layer_types": FULL_LINEAR_LINEAR,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "block_size": 4,  # the lightning attention's chunk: several chunks over the prompt
        "full_attn_alpha_factor": 1.5,
        "full_attn_beta_factor": 0.5,
        "linear_attn_alpha_factor": 2.0,
        "linear_attn_beta_factor": 0.25,
        "mlp_alpha_factor": 0.75,
        "mlp_beta_factor": 3.0,
    },
    "recurrent_gemma": {
        "block_types": ["attention", "recurrent", "recurrent"],
        "lru_width": 128,
        "attention_window_size": 64,
        "logits_soft_cap": 5.0,
    },
    "rwkv": {"attention_hidden_size": 128, "context_length": 256},
    "xlstm": {"num_heads": 4, "embedding_dim": 128, "output_logit_soft_cap": 5.0},
}
