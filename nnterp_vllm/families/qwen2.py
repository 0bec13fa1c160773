"""Qwen2 (``Qwen2ForCausalLM``): the llama layout."""

from transformers.models.qwen2 import modeling_qwen2 as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.Qwen2DecoderLayer: Layer, hf.Qwen2Attention: Attention, hf.Qwen2MLP: Mlp}
