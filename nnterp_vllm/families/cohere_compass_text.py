"""Cohere Compass text (``CohereCompassForCausalLM``): Command-R's parallel block, rotary per layer type.

Attention and MLP read one norm and both add to the residual stream; a layer type whose
``rope_parameters`` entry is ``None`` has no rotary. The head's logits are multiplied by
``config.logit_scale`` (1 when unset).
"""

from typing import Any

import torch
from transformers.models.cohere_compass import modeling_cohere_compass as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.CohereCompassDecoderLayer: Layer, hf.CohereCompassAttention: Attention, hf.CohereCompassMLP: Mlp}


def post_head(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """The head's output times ``config.logit_scale``, as the model's forward does."""
    return logits * (model.config.get_text_config().logit_scale or 1.0)
