"""Llama (``LlamaForCausalLM``): transformers' shared layout, which the base components serve as they are."""

from transformers.models.llama import modeling_llama as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.LlamaDecoderLayer: Layer, hf.LlamaAttention: Attention, hf.LlamaMLP: Mlp}
