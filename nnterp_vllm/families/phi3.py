"""Phi3 (``Phi3ForCausalLM``): the llama layout."""

from transformers.models.phi3 import modeling_phi3 as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.Phi3DecoderLayer: Layer, hf.Phi3Attention: Attention, hf.Phi3MLP: Mlp}
