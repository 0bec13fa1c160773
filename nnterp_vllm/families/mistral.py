"""Mistral (``MistralForCausalLM``): the llama layout."""

from transformers.models.mistral import modeling_mistral as hf

from ._layouts import LLAMA_RENAME as RENAME
from ._layouts import classes

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.MistralDecoderLayer: Layer, hf.MistralAttention: Attention, hf.MistralMLP: Mlp}
__all__ = ["RENAME", "ENVOYS", "Layer", "Attention", "Mlp"]
