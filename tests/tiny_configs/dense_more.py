"""Dense decoders and odd layouts (muP multipliers, latent attention, post-norm blocks, wrapped heads): their keys.

Multipliers and scales are set away from 1 so a family that forgets one fails; sliding windows are 16
(shorter than the test prompt) and alternate with full attention where the family mixes the two.
"""

from typing import Any

OVERRIDES: dict[str, dict[str, Any]] = {
    "hyperclovax": {
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 4.0,
        "use_post_norm": True,
    },
    "aria_text": {"moe_num_experts": 4, "moe_topk": 2, "moe_num_shared_experts": 1, "intermediate_size": 64},
    "granite_swa": {
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 4.0,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "layer_rope_theta": [10000.0, 0, 10000.0],
    },
    "minicpm3": {
        "num_key_value_heads": 4,  # its keys are expanded to every head before the attention call
        "q_lora_rank": 64,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 32,
        "dim_model_base": 64,
        "scale_emb": 3.0,
        "scale_depth": 2.0,
    },
    "moshi": {"ffn_dim": 512},
}
