"""Qwen3 (``Qwen3ForCausalLM``): the llama layout."""

from transformers.models.qwen3 import modeling_qwen3 as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.Qwen3DecoderLayer: Layer, hf.Qwen3Attention: Attention, hf.Qwen3MLP: Mlp}
