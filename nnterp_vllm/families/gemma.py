"""Gemma (``GemmaForCausalLM``): the llama layout."""

from transformers.models.gemma import modeling_gemma as hf

from ._layouts import LLAMA_RENAME as RENAME
from ._layouts import classes

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.GemmaDecoderLayer: Layer, hf.GemmaAttention: Attention, hf.GemmaMLP: Mlp}
__all__ = ["RENAME", "ENVOYS", "Layer", "Attention", "Mlp"]
