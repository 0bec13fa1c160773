"""Helium (``HeliumForCausalLM``): the llama layout."""

from transformers.models.helium import modeling_helium as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.HeliumDecoderLayer: Layer, hf.HeliumAttention: Attention, hf.HeliumMLP: Mlp}
