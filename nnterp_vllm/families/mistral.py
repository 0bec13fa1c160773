"""Mistral (``MistralForCausalLM``): the llama layout."""

from transformers.models.mistral import modeling_mistral as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.MistralDecoderLayer: Layer, hf.MistralAttention: Attention, hf.MistralMLP: Mlp}
