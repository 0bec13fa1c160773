"""EXAONE 4 (``Exaone4ForCausalLM``): the llama layout, norming each sublayer's output instead of its input."""

from transformers.models.exaone4 import modeling_exaone4 as hf

from ._layouts import LLAMA_RENAME, PostNormLayer, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, layer=PostNormLayer)
ENVOYS = {hf.Exaone4DecoderLayer: Layer, hf.Exaone4Attention: Attention, hf.Exaone4MLP: Mlp}
