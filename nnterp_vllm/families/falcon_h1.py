"""Falcon-H1 (``FalconH1ForCausalLM``): Jamba's containers; each block runs a mamba-2 scan and attention in parallel.

Both read the same normed input (the attention's times ``attention_in_multiplier``); the block adds the scan's
output times ``ssm_out_multiplier`` plus the attention's times ``attention_out_multiplier``, so ``mixer_output``
is that sum (an assignment in the block's forward) and ``mixer.mixer_output`` the scan's share of it. The MLP
(``feed_forward``, served as ``mlp``) applies its multipliers inside. Embeddings are scaled by
``embedding_multiplier`` (``token_embeddings`` is the table's output) and logits by ``lm_head_multiplier``.
"""

from typing import Any

import torch
from transformers.models.falcon_h1 import modeling_falcon_h1 as hf

from ..components import Layer as BaseLayer
from ..components import Mixer as BaseMixer
from ..components import Value, unavailable
from ._layouts import classes
from .jamba import HYBRID_RENAME

RENAME = HYBRID_RENAME


class ParallelLayer(BaseLayer):
    SOURCED = True  # the mixer's contribution is an assignment inside the block's forward
    mixer_output = Value(
        "source.hidden_states_1.output", description="The scan's and attention's scaled outputs, summed"
    )
    attention_output = unavailable(
        "the block adds the attention's output and the mamba scan's, run in parallel, as one sum; read mixer_output "
        "for the sum, self_attn.attention_output for the attention's own output"
    )


class Mixer(BaseMixer):
    mixer_output = Value(
        "../source.mamba_hidden_states_1.output",
        description="The scan's output times ssm_out_multiplier: its share of the block's mixer_output",
    )


Layer, Attention, Mlp = classes(__name__, layer=ParallelLayer)
ENVOYS = {hf.FalconH1DecoderLayer: Layer, hf.FalconH1Attention: Attention, hf.FalconH1Mixer: Mixer, hf.FalconH1MLP: Mlp}


def post_head(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """The head's output times ``config.lm_head_multiplier``, as the model's forward does."""
    return logits * model.config.get_text_config().lm_head_multiplier
