"""Qwen3 (``Qwen3ForCausalLM``): the llama layout."""

from transformers.models.qwen3 import modeling_qwen3 as hf

from ._layouts import LLAMA_RENAME as RENAME
from ._layouts import classes

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.Qwen3DecoderLayer: Layer, hf.Qwen3Attention: Attention, hf.Qwen3MLP: Mlp}
__all__ = ["RENAME", "ENVOYS", "Layer", "Attention", "Mlp"]
