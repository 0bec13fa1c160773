"""Ministral (``MinistralForCausalLM``): the llama layout, with sliding-window layers."""

from transformers.models.ministral import modeling_ministral as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.MinistralDecoderLayer: Layer, hf.MinistralAttention: Attention, hf.MinistralMLP: Mlp}
