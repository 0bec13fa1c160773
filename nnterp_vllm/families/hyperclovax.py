"""HyperCLOVA X (``HyperCLOVAXForCausalLM``): the llama layout with muP multipliers and optional peri-layer norms.

Each sublayer's output goes through its post-norm (``post_norm1``/``post_norm2``, identities when the config
sets ``use_post_norm=False``) and is multiplied by ``residual_multiplier`` before it is added, so that product
is the sublayer's contribution (a write is divided by the multiplier before it reaches the norm's output).
The embeddings are multiplied by ``embedding_multiplier`` before the first block: ``token_embeddings`` is the
embedding table's output, ``layers[0].layer_input`` the scaled stream. The head's logits are *multiplied* by
``config.logits_scaling`` (Granite divides by it).
"""

from typing import Any

import torch
from transformers.models.hyperclovax import modeling_hyperclovax as hf

from ..components import Layer, Scaled
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME


class HyperCLOVAXLayer(Layer):
    attention_output = Scaled(
        "post_norm1.output", scale="residual_multiplier", description=Layer.attention_output.description
    )
    mlp_output = Scaled("post_norm2.output", scale="residual_multiplier", description=Layer.mlp_output.description)


Layer, Attention, Mlp = classes(__name__, layer=HyperCLOVAXLayer)
ENVOYS = {hf.HyperCLOVAXDecoderLayer: Layer, hf.HyperCLOVAXAttention: Attention, hf.HyperCLOVAXMLP: Mlp}


def post_head(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """The head's output times ``config.logits_scaling``, as the model's forward does."""
    return logits * model.config.get_text_config().logits_scaling
