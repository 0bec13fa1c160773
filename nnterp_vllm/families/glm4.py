"""GLM-4 (``Glm4ForCausalLM``): the llama layout with a norm after each sublayer (``post_self_attn_layernorm``,
``post_mlp_layernorm``) besides the norms before them; the post-norms' outputs are what the block adds.
"""

from transformers.models.glm4 import modeling_glm4 as hf

from ..components import Layer, Value
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME


class Glm4Layer(Layer):
    attention_output = Value("post_self_attn_layernorm.output", description=Layer.attention_output.description)
    mlp_output = Value("post_mlp_layernorm.output", description=Layer.mlp_output.description)


Layer, Attention, Mlp = classes(__name__, layer=Glm4Layer)
ENVOYS = {hf.Glm4DecoderLayer: Layer, hf.Glm4Attention: Attention, hf.Glm4MLP: Mlp}
