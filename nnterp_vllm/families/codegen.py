"""CodeGen (``CodeGenForCausalLM``): GPT-J's layout (GPT-2 containers, a parallel block, ``_attn`` of its own).

Its ``_attn`` applies the softmax as a module built on the spot, ``nn.Softmax(dim=-1)(scores)``.
"""

from typing import Any

from transformers.models.codegen import modeling_codegen as hf

from ..components import Attention
from ._layouts import GPT2_RENAME, classes

RENAME = GPT2_RENAME


class CodeGenAttention(Attention):
    INTERFACE = "self__attn_0"
    QKV_ARGS = (0, 1, 2)
    SCORES = "call_0.input"
    PROBABILITIES = "self_attn_dropout_0.output"
    PREMIX_HEADS_FIRST = True
    OUTPUT_PROJECTION = "out_proj"


Layer, Attention, Mlp = classes(__name__, attention=CodeGenAttention)
ENVOYS = {hf.CodeGenBlock: Layer, hf.CodeGenAttention: Attention, hf.CodeGenMLP: Mlp}


def intermediate_size(model: Any) -> int:
    """The MLP width is ``n_inner``; unset means four times the hidden size."""
    return model.config.n_inner or 4 * model.hidden_size
