"""GIT: a one-layer vision tower under the tiny text sizes (the test prompt has no image tokens)."""

from typing import Any

OVERRIDES: dict[str, dict[str, Any]] = {
    "git": {
        "vision_config": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
        }
    },
}
