"""Apertus (``ApertusForCausalLM``): the llama layout (norms ``attention_layernorm``, ``feedforward_layernorm``)."""

from transformers.models.apertus import modeling_apertus as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.ApertusDecoderLayer: Layer, hf.ApertusAttention: Attention, hf.ApertusMLP: Mlp}
