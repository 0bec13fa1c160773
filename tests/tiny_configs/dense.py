"""Dense decoder-only families on (or near) the llama layout: the keys their tiny checkpoints need.

Sliding windows are 16 (shorter than the test prompt, so the window mask is exercised) and
alternate with full attention where the family mixes the two; multipliers and scales are set
away from 1 so a family that forgets one fails.
"""

from typing import Any

#: llama3 rope scaled down to the tiny context (the default's original context is longer than the model's).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}
SLIDING = {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}

OVERRIDES: dict[str, dict[str, Any]] = {
    "apertus": {"rope_parameters": LLAMA3_ROPE},
    "arcee": {},
    "cohere": {"use_qk_norm": True, "logit_scale": 0.5},
    "cohere2": {**SLIDING, "logit_scale": 0.5},
    "cwm": {
        "rope_parameters": LLAMA3_ROPE,
        "sliding_window": 16,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"],
    },
    "exaone4": SLIDING,
    "glm": {},
    "glm4": {},
    "granite": {
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 4.0,
    },
    "helium": {},
    "hunyuan_v1_dense": {},
    "ministral": SLIDING,
    "ministral3": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale_all_dim": 1.0,
            "mscale": 1.0,
            "llama_4_scaling_beta": 0.1,
        }
    },
    "nanochat": {"final_logit_softcapping": 15.0},
    "nemotron": {},
    "olmo": {"clip_qkv": 8.0},
    "olmo3": SLIDING,
    "seed_oss": {"attention_bias": True},
    "smollm3": {"no_rope_layer_interval": 2},
    "stablelm": {"use_parallel_residual": True, "qk_layernorm": True},
    "starcoder2": {},
    "vaultgemma": {**SLIDING, "query_pre_attn_scalar": 32, "tie_word_embeddings": True},
    "ernie4_5": {},
    "youtu": {
        "num_key_value_heads": 4,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 32,
        "v_head_dim": 32,
        "kv_lora_rank": 64,
        "q_lora_rank": 64,
    },
    "jais2": {},
    "doge": {},
    "diffllama": {},
}
