"""ERNIE 4.5 (``Ernie4_5ForCausalLM``): the llama layout."""

from transformers.models.ernie4_5 import modeling_ernie4_5 as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.Ernie4_5DecoderLayer: Layer, hf.Ernie4_5Attention: Attention, hf.Ernie4_5MLP: Mlp}
