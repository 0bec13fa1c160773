"""Inkling text (``InklingForCausalLM``): the llama layout with a short convolution after each sublayer.

Each block adds ``attn_sconv(self_attn(...))`` and ``mlp_sconv(mlp(...))``, so what it adds is read
on the convolutions. The attention adds a relative position bias to the scores before the mask, so
equal keys do not give a uniform pattern; sliding blocks (``hybrid_sliding``) have their own head
layout. ``mlp`` is a dense MLP on the ``dense`` entries of ``mlp_layer_types``, else a sparse block
whose router ``gate`` returns ``(routed logits, weights, indices, shared experts' weights)``. The
head reads the final norm's output divided by ``logits_mup_width_multiplier`` and drops the logits
past ``unpadded_vocab_size``.
"""

from typing import Any

import torch
from transformers.models.inkling import modeling_inkling as hf

from ..components import Layer as BaseLayer
from ..components import Value
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME


class ConvolvedLayer(BaseLayer):
    """A block whose sublayers' outputs pass through a short convolution before they are added."""

    attention_output = Value("attn_sconv.output", description=BaseLayer.attention_output.description)
    mlp_output = Value("mlp_sconv.output", description=BaseLayer.mlp_output.description)


Layer, Attention, Mlp = classes(__name__, layer=ConvolvedLayer, mlp_names={"ROUTER": "gate"})
ENVOYS = {hf.InklingDecoderLayer: Layer, hf.InklingAttention: Attention, hf.InklingMoE: Mlp, hf.InklingMLP: Mlp}


def post_head(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """The head's output divided by ``logits_mup_width_multiplier``, cut to ``unpadded_vocab_size``."""
    config = model.config.get_text_config()
    logits = logits / config.logits_mup_width_multiplier
    return logits[..., : config.unpadded_vocab_size] if config.unpadded_vocab_size else logits
