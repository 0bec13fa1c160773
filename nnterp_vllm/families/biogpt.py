"""BioGPT (``BioGptForCausalLM``): ``biogpt.*`` and ``output_projection``; OPT's block (an MLP of bare linears)."""

from transformers.models.biogpt import modeling_biogpt as hf

from ._layouts import classes
from .opt import OPTAttention, OPTLayer

RENAME = {
    "biogpt.embed_tokens": "embed_tokens",
    "biogpt.layers": "layers",
    "biogpt.layer_norm": "norm",
    "output_projection": "lm_head",
}


Layer, Attention, Mlp = classes(__name__, layer=OPTLayer, attention=OPTAttention)
ENVOYS = {hf.BioGptDecoderLayer: Layer, hf.BioGptAttention: Attention}
