"""Gemma (``GemmaForCausalLM``): the llama layout."""

from transformers.models.gemma import modeling_gemma as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.GemmaDecoderLayer: Layer, hf.GemmaAttention: Attention, hf.GemmaMLP: Mlp}
