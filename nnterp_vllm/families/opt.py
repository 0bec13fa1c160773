"""OPT (``OPTForCausalLM``): ``model.decoder.*``, and an MLP of two bare linears on the block (no MLP module)."""

from typing import Any

from transformers.models.opt import modeling_opt as hf

from ..components import Attention, Layer, Value
from ._layouts import classes

RENAME = {
    "model.decoder.embed_tokens": "embed_tokens",
    "model.decoder.layers": "layers",
    "model.decoder.final_layer_norm": "norm",
}


class OPTLayer(Layer):
    mlp_output = Value("fc2.output", description=Layer.mlp_output.description)


class OPTAttention(Attention):
    OUTPUT_PROJECTION = "out_proj"


Layer, Attention, Mlp = classes(__name__, layer=OPTLayer, attention=OPTAttention)
ENVOYS = {hf.OPTDecoderLayer: Layer, hf.OPTAttention: Attention}


def intermediate_size(model: Any) -> int:
    """The MLP width is ``ffn_dim``."""
    return model.config.ffn_dim
