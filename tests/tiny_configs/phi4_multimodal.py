"""Phi-4-multimodal: a one-layer vision tower and a one-block audio encoder, so the text model keeps the tiny sizes.

The top-level text keys take ``tests/tiny.py``'s sizes as they are (heads 128 / 4 = 32 wide), with the
checkpoint's partial rotary; the image and audio embeddings a text prompt never reaches only need to be small.
"""

from typing import Any

OVERRIDES: dict[str, dict[str, Any]] = {
    "phi4_multimodal": {
        "partial_rotary_factor": 0.75,  # as Phi-4-multimodal's checkpoint: rotary on 24 of each head's 32 dims
        "vision_config": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 32,
            "crop_size": 32,
            "patch_size": 8,
        },
        "audio_config": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_blocks": 1,
            "num_attention_heads": 2,
            "depthwise_separable_out_channel": 64,
            "ext_pw_out_channel": 64,
            "nemo_conv_channels": 16,
            "bias_max_distance": 64,
        },
    },
}
