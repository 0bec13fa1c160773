"""Doge (``DogeForCausalLM``): the llama layout with dynamic-mask attention and learned residual weights.

The block computes ``input_residual * x + attn(...)`` and then ``post_attention_residual * h +
mlp(...)``: the residual stream itself is rescaled channel by channel, so no sublayer output is
what the block adds, and ``attention_output``/``mlp_output`` are not served on the block (the
sublayers' own outputs are, on ``self_attn`` and ``mlp``). The dynamic mask is added to the
scores before the softmax, so ``attention_scores`` include it.
"""

from transformers.models.doge import modeling_doge as hf

from ..components import Layer, unavailable
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME
RESCALED = (
    "the block rescales the residual stream by learned per-channel weights (input_residual, "
    "post_attention_residual) before adding each sublayer, so layer_output != layer_input + attention + mlp; "
    "read self_attn.attention_output / mlp.mlp_output for the sublayers' outputs"
)


class DogeLayer(Layer):
    attention_output = unavailable(RESCALED)
    mlp_output = unavailable(RESCALED)


Layer, Attention, Mlp = classes(__name__, layer=DogeLayer)
ENVOYS = {hf.DogeDecoderLayer: Layer, hf.DogeAttention: Attention, hf.DogeMLP: Mlp, hf.DogeCDMoE: Mlp}
