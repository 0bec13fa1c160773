"""Ministral 3 (``Ministral3ForCausalLM``): the llama layout; queries are scaled by position before the scores."""

from transformers.models.ministral3 import modeling_ministral3 as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.Ministral3DecoderLayer: Layer, hf.Ministral3Attention: Attention, hf.Ministral3MLP: Mlp}
