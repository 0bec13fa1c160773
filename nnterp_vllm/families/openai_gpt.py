"""GPT (``OpenAIGPTLMHeadModel``): ``transformer.{tokens_embed, h}``, post-norm blocks and no final norm.

The block computes ``n = ln_1(x + attn(x))`` and ``ln_2(n + mlp(n))``: the residual stream itself is
normed after each sublayer is added, so no sublayer output is what the block adds, and
``attention_output``/``mlp_output`` are not served on the block (the sublayers' own outputs are, on
``self_attn`` and ``mlp``). The last block's output goes to the head as it is. The block and its
attention return lists, whose first element is the tensor. The attention does its own arithmetic
(``_attn``), with keys split transposed (``[batch, heads, head_dim, seq]``), served in the standard layout.
"""

from typing import Any

import torch
from transformers.models.openai import modeling_openai as hf

from ..components import Attention, Layer, Value, unavailable
from ..components.attention import interior
from ._layouts import classes

#: A post-norm block: ``ln_1`` norms the stream after attention (where llama's ``post_attention_layernorm``
#: sits), ``ln_2`` after the MLP (llama has no such norm).
RENAME = {
    "transformer.tokens_embed": "embed_tokens",
    "transformer.h": "layers",
    "attn": "self_attn",
    "ln_1": "post_attention_layernorm",
    "ln_2": "ln_2",
}
NO_FINAL_NORM = "GPT has no final norm: the last block's output (itself normed by its ln_2) goes to the head as it is"
UNAVAILABLE = {"final_norm_output": NO_FINAL_NORM + "; read layers[-1].layer_output"}
POST_NORM = (
    "the block norms the residual stream after adding each sublayer (ln_1(x + attn), ln_2(n + mlp)), so "
    "layer_output != layer_input + attention + mlp; read self_attn.attention_output / mlp.mlp_output for the "
    "sublayers' outputs"
)


class GPTLayer(Layer):
    layer_output = Value("output", select=0, description=Layer.layer_output.description)
    attention_output = unavailable(POST_NORM)
    mlp_output = unavailable(POST_NORM)


class GPTAttention(Attention):
    INTERFACE = "self__attn_0"
    QKV_ARGS = (0, 1, 2)
    PROBABILITIES = "self_attn_dropout_0.output"
    OUTPUT_PROJECTION = "c_proj"
    PREMIX = "source.self_merge_heads_0.input"  # heads first, as merge_heads receives it
    PREMIX_HEADS_FIRST = True

    attention_output = Value("output", select=0, description=Attention.attention_output.description)

    @interior("source.{self.INTERFACE}.inputs", Attention.attention_keys.description, select=1)
    def attention_keys(self, value: Any) -> Any:
        """The keys as ``_attn`` receives them, ``[batch, heads, head_dim, seq]``, in the standard layout."""
        return value.transpose(-1, -2)

    @attention_keys.postprocess
    def attention_keys(self, value: Any) -> Any:
        return value.transpose(-1, -2)


Layer, Attention, Mlp = classes(__name__, layer=GPTLayer, attention=GPTAttention)
ENVOYS = {hf.Block: Layer, hf.Attention: Attention, hf.MLP: Mlp}


def final_norm(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The stream as it is: the model has no final norm."""
    return hidden


def intermediate_size(model: Any) -> int:
    """The MLP width is four times the hidden size."""
    return 4 * model.hidden_size
