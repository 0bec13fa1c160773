"""Multimodal wrappers served by their text family: the keys their tiny checkpoints need.

A wrapper's config nests the text model's keys under ``text_config`` (the top-level tiny sizes do
not reach it), so each spells there the keys its text type's tiny checkpoint is built with, and a
small vision tower where the causal-LM class builds one (the causal-LM classes of Llama-4, Qwen3.5,
Qwen3.5-MoE and Qwen4-exp hold the text model alone).
"""

from typing import Any

#: The tiny sizes of ``tests/tiny.py`` that every text config here takes.
TEXT = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
#: Grouped keys and values, heads 32 wide.
GQA = {**TEXT, "num_key_value_heads": 2, "head_dim": 32}
#: The same without a dense MLP width (a config whose every MLP is sparse has none).
GQA_SPARSE = {key: value for key, value in GQA.items() if key != "intermediate_size"}
#: A one-layer vision tower over 32x32 images.
VISION = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
}
#: Gated-delta-net heads that fit the tiny width; softmax attention first, then two linear-attention blocks.
DELTA_NET = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "layer_types": ["full_attention", "linear_attention", "linear_attention"],
}
QWEN_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
}
#: Sliding, full, full: the last layer shares the keys and values of the full layer before it.
GEMMA4_LAYERS = {
    "global_head_dim": 64,
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention", "full_attention"],
    "num_kv_shared_layers": 1,
    "attention_k_eq_v": True,
    "final_logit_softcapping": 5.0,
}

OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma3": {
        "text_config": {**GQA, "sliding_window": 16, "query_pre_attn_scalar": 32, "tie_word_embeddings": True},
        "vision_config": VISION,
        "mm_tokens_per_image": 4,
    },
    "gemma4": {
        "text_config": {
            **GQA,
            **GEMMA4_LAYERS,
            "hidden_size_per_layer_input": 16,
            "vocab_size_per_layer_input": 512,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 64,
        }
    },
    "gemma4_unified": {"text_config": {**GQA, **GEMMA4_LAYERS}},
    "llama4": {
        "text_config": {
            **GQA,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,  # each expert's width; the dense blocks' is intermediate_size_mlp
            "intermediate_size_mlp": 256,
            "moe_layers": [1, 2],
            "no_rope_layers": [1, 1, 0],  # the last block has no rotary and a position-dependent query scale
            "floor_scale": 4,
            "attn_scale": 0.5,
        }
    },
    "qwen3_5": {"text_config": {**GQA, **DELTA_NET}},
    "qwen3_5_moe": {"text_config": {**GQA_SPARSE, **DELTA_NET, **QWEN_MOE}},
    "qwen4_exp": {
        "text_config": {
            **GQA_SPARSE,
            **DELTA_NET,
            **QWEN_MOE,
            "layer_types": ["indexed_attention", "linear_attention", "linear_attention"],
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
        }
    },
    "got_ocr2": {
        "text_config": {**TEXT, "num_key_value_heads": 2},
        "vision_config": {
            "hidden_size": 64,
            "output_channels": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "mlp_dim": 128,
            "image_size": 64,
            "patch_size": 16,
            "window_size": 2,
            "global_attn_indexes": [0],
        },
    },
    "fuyu": {"text_config": TEXT, "image_size": 32, "patch_size": 8},  # a persimmon text model
}
