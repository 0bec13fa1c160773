"""OLMo-3 (``Olmo3ForCausalLM``): the llama layout, norming each sublayer's output instead of its input."""

from transformers.models.olmo3 import modeling_olmo3 as hf

from ._layouts import LLAMA_RENAME, PostNormLayer, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, layer=PostNormLayer)
ENVOYS = {hf.Olmo3DecoderLayer: Layer, hf.Olmo3Attention: Attention, hf.Olmo3MLP: Mlp}
