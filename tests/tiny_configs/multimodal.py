"""Multimodal wrappers served by their text family: the keys their tiny checkpoints need.

A wrapper's ``text_config`` takes the keys its text model_type's tiny checkpoint is built with
(``tests/tiny.py`` fills it in); what is here is the small vision tower where the causal-LM class
builds one (the causal-LM classes of Gemma-4, Llama-4, Qwen3.5, Qwen3.5-MoE and Qwen4-exp hold the
text model alone, so they need nothing of their own).
"""

from typing import Any

#: A one-layer vision tower over 32x32 images.
VISION = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
}

OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma3": {"vision_config": VISION, "mm_tokens_per_image": 4},
    "gemma4": {},
    "gemma4_unified": {},
    "llama4": {},
    "qwen3_5": {},
    "qwen3_5_moe": {},
    "qwen4_exp": {},
    "got_ocr2": {
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
    "fuyu": {"image_size": 32, "patch_size": 8},  # a persimmon text model
}
