"""DeepSeek-like and other routed mixture-of-experts decoders: the keys their tiny checkpoints need.

Four experts, two per token, small expert widths; a dense first block where the family mixes
dense and sparse blocks; routed scalings away from 1.
"""

from typing import Any

#: DeepSeek-style routing: routed experts, a shared expert, a routed scaling.
ROUTED = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "routed_scaling_factor": 2.0,
}
#: Multi-head latent attention at the tiny sizes; its keys are expanded to every head.
LATENT = {
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "num_key_value_heads": 4,
}
DENSE_FIRST = {"mlp_layer_types": ["dense", "sparse", "sparse"]}
#: DeepSeek sparse attention's indexer at the tiny sizes; it keeps every key of the 30-token test prompt.
INDEXER = {"index_n_heads": 2, "index_head_dim": 64, "index_topk": 64}

OVERRIDES: dict[str, dict[str, Any]] = {
    "glm4_moe_lite": {**ROUTED, **LATENT, **DENSE_FIRST},
    "deepseek_v32": {**ROUTED, **LATENT, **DENSE_FIRST, **INDEXER, "n_group": 2, "topk_group": 1},
    "longcat_flash": {
        **LATENT,
        "num_layers": 3,  # blocks of two attention sublayers each; ``num_hidden_layers`` is twice this
        "ffn_hidden_size": 256,
        "n_routed_experts": 4,
        "zero_expert_num": 2,  # identity experts, routed like the others
        "moe_topk": 2,
        "expert_ffn_hidden_size": 64,
        "routed_scaling_factor": 2.0,
    },
    "llama4_text": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,  # each expert's width; the dense blocks' is intermediate_size_mlp
        "intermediate_size_mlp": 256,
        "moe_layers": [1, 2],
        "no_rope_layers": [1, 1, 0],  # the last block has no rotary and a position-dependent query scale
        "floor_scale": 4,
        "attn_scale": 0.5,
    },
    "minimax_m3_vl_text": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "dense_intermediate_size": 256,
        "shared_intermediate_size": 64,
        "rotary_dim": 16,
        "index_n_heads": 2,  # one block choice per key-value head
        "index_head_dim": 16,
        "index_block_size": 4,
        "index_topk_blocks": 2,  # fewer than the test prompt's 8 blocks, so the choice matters
        "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
        **DENSE_FIRST,
    },
    "inkling_text": {
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,  # sliding blocks have their own head layout
        "swa_head_dim": 32,
        "sliding_window_size": 16,
        "d_rel": 4,
        "rel_extent": 64,
        "log_scaling_n_floor": 4,  # full-attention blocks scale queries and position bias by log position
        "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
        **DENSE_FIRST,
        "moe_intermediate_size": 64,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "route_scale": 2.0,
        "logits_mup_width_multiplier": 4.0,
        "unpadded_vocab_size": 500,
    },
    "cohere_compass_text": {
        "logit_scale": 0.5,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {  # rotary on sliding blocks only; sections sized for head_dim 32
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 6, 4]},
            "full_attention": None,
        },
    },
    "deepseek_v4": {
        "num_key_value_heads": 1,  # one key-value head shared by every query head
        "q_lora_rank": 64,
        "partial_rotary_factor": 0.5,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 64,
        "routed_scaling_factor": 2.0,
        "hc_mult": 2,
        "sliding_window": 16,
        "o_groups": 2,
        "o_lora_rank": 32,
        "index_n_heads": 2,
        "index_head_dim": 32,
        "index_topk": 4,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
    },
    "glm_moe_dsa": {
        **ROUTED,
        **LATENT,
        **DENSE_FIRST,
        **INDEXER,
        "indexer_types": ["full", "shared", "full"],  # a block reusing the previous block's choice of keys
    },
}
