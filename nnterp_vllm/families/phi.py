"""Phi-1/1.5/2 (``PhiForCausalLM``): the llama containers with ``model.final_layernorm``, a parallel block, ``dense``.

Attention and MLP read the same normed input and both add to the residual stream.
"""

from transformers.models.phi import modeling_phi as hf

from ..components import Attention
from ._layouts import classes

RENAME = {"model.layers": "layers", "model.embed_tokens": "embed_tokens", "model.final_layernorm": "norm"}


class PhiAttention(Attention):
    OUTPUT_PROJECTION = "dense"


Layer, Attention, Mlp = classes(__name__, attention=PhiAttention)
ENVOYS = {hf.PhiDecoderLayer: Layer, hf.PhiAttention: Attention, hf.PhiMLP: Mlp}
