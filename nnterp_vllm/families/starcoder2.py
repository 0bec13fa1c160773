"""StarCoder2 (``Starcoder2ForCausalLM``): the llama layout (LayerNorms, a ``c_fc``/``c_proj`` MLP)."""

from transformers.models.starcoder2 import modeling_starcoder2 as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.Starcoder2DecoderLayer: Layer, hf.Starcoder2Attention: Attention, hf.Starcoder2MLP: Mlp}
