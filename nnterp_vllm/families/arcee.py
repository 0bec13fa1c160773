"""Arcee (``ArceeForCausalLM``): the llama layout."""

from transformers.models.arcee import modeling_arcee as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.ArceeDecoderLayer: Layer, hf.ArceeAttention: Attention, hf.ArceeMLP: Mlp}
