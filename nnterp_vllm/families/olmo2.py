"""OLMo-2 (``Olmo2ForCausalLM``): the llama layout, norming each sublayer's output instead of its input."""

from transformers.models.olmo2 import modeling_olmo2 as hf

from ._layouts import LLAMA_RENAME, PostNormLayer, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, layer=PostNormLayer)
ENVOYS = {hf.Olmo2DecoderLayer: Layer, hf.Olmo2Attention: Attention, hf.Olmo2MLP: Mlp}
