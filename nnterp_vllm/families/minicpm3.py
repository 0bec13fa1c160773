"""MiniCPM3 (``MiniCPM3ForCausalLM``): the llama layout with latent attention and depth-scaled residual branches.

Each sublayer's output is multiplied by the block's ``residual_scale`` (``scale_depth / sqrt(num_layers)``)
before it is added, so that product is the sublayer's contribution (a write is divided by the scale
before it reaches the module's output). The embedding table scales its own output by ``scale_emb``.
The latent keys and values are expanded to every head before the attention call, so the interior has
the standard shapes. The final norm's output is divided by ``config.logits_scaling`` before the head.
"""

from typing import Any

import torch
from transformers.models.minicpm3 import modeling_minicpm3 as hf

from ..components import Layer, Scaled
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME


class MiniCPM3Layer(Layer):
    attention_output = Scaled(
        "self_attn.output", scale="residual_scale", description=Layer.attention_output.description
    )
    mlp_output = Scaled("mlp.output", scale="residual_scale", description=Layer.mlp_output.description)


Layer, Attention, Mlp = classes(__name__, layer=MiniCPM3Layer)
ENVOYS = {hf.MiniCPM3DecoderLayer: Layer, hf.MiniCPM3Attention: Attention, hf.MiniCPM3MLP: Mlp}


def final_norm(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The final norm, then the division by ``config.logits_scaling`` the model applies before its head."""
    return model.norm(hidden) / model.config.get_text_config().logits_scaling
