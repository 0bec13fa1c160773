"""Moshi text decoder (``MoshiForCausalLM``): the llama layout with projections wrapped in ``MoshiLinear``.

Each projection is a ``MoshiLinear`` holding the ``nn.Linear`` it calls (``o_proj.linear``); the MLP
is a gated ``fc1``/``fc2`` pair whose width is ``ffn_dim // 2``.
"""

from typing import Any

from nnsight.intervention.envoy import Envoy
from transformers.models.moshi import modeling_moshi as hf

from ..components import Attention
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME


class MoshiAttention(Attention):
    OUTPUT_PROJECTION = "o_proj.linear"

    @property
    def output_projection(self) -> Envoy:
        return self.o_proj.linear


Layer, Attention, Mlp = classes(__name__, attention=MoshiAttention)
ENVOYS = {hf.MoshiDecoderLayer: Layer, hf.MoshiAttention: Attention, hf.MoshiGatingMLP: Mlp}


def intermediate_size(model: Any) -> int:
    """The gated MLP's width: ``fc1`` projects to ``ffn_dim``, split into gate and up halves."""
    return model.config.ffn_dim // 2
