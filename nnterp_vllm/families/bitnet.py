"""BitNet b1.58 (``BitNetForCausalLM``): the llama layout, and a norm (``attn_sub_norm``) before ``o_proj``.

The sub-norm normalizes all heads' mix together before the output projection, so no head has a contribution of its
own after it.
"""

from transformers.models.bitnet import modeling_bitnet as hf

from ..components import Attention, unavailable
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME


class BitNetAttention(Attention):
    attention_head_outputs = unavailable(
        "attn_sub_norm normalizes the heads' mix together before o_proj, so the output has no per-head split"
    )


Layer, Attention, Mlp = classes(__name__, attention=BitNetAttention)
ENVOYS = {hf.BitNetDecoderLayer: Layer, hf.BitNetAttention: Attention, hf.BitNetMLP: Mlp}
