"""Granite (``GraniteForCausalLM``): the llama layout with muP-style multipliers.

The block adds each sublayer's output times ``residual_multiplier``, so that product is the
sublayer's contribution (a write is divided by the multiplier before it reaches the module's
output). The head's logits are divided by ``config.logits_scaling``. The embeddings are
multiplied by ``embedding_multiplier`` before the first block: ``token_embeddings`` is the
embedding table's output, ``layers[0].layer_input`` the scaled stream.
"""

from typing import Any

import torch
from transformers.models.granite import modeling_granite as hf

from ..components import Layer, Scaled
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME


class GraniteLayer(Layer):
    attention_output = Scaled(
        "self_attn.output", scale="residual_multiplier", description=Layer.attention_output.description
    )
    mlp_output = Scaled("mlp.output", scale="residual_multiplier", description=Layer.mlp_output.description)


Layer, Attention, Mlp = classes(__name__, layer=GraniteLayer)
ENVOYS = {hf.GraniteDecoderLayer: Layer, hf.GraniteAttention: Attention, hf.GraniteMLP: Mlp}


def post_head(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """The head's output divided by ``config.logits_scaling``, as the model's forward does."""
    return logits / model.config.get_text_config().logits_scaling
