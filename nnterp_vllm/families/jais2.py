"""Jais 2 (``Jais2ForCausalLM``): the llama layout (LayerNorms, a two-linear MLP)."""

from transformers.models.jais2 import modeling_jais2 as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.Jais2DecoderLayer: Layer, hf.Jais2Attention: Attention, hf.Jais2MLP: Mlp}
