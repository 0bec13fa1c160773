"""MPT (``MptForCausalLM``): ``transformer.{wte, blocks, norm_f}``; ALiBi attention with arithmetic of its own.

The MLP (``ffn``) adds the residual inside: its contribution is its ``F.dropout`` call's output. The block drops out
the attention's output (``resid_attn_dropout``) before adding it.
"""

from typing import Any

from transformers.models.mpt import modeling_mpt as hf

from ..components import WHOLE, Attention, Mlp, Value
from ._layouts import classes

RENAME = {
    "transformer.wte": "embed_tokens",
    "transformer.blocks": "layers",
    "transformer.norm_f": "norm",
    "attn": "self_attn",
    "ffn": "mlp",
}


def _value(key: str, base: str, select: Any = WHOLE) -> Value:
    return Value(
        f"source.{key}",
        select=select,
        description=vars(Attention)[base].description,
        unavailable=lambda attention: attention.interior_reason(),
    )


class MptAttention(Attention):
    OUTPUT_PROJECTION = "out_proj"
    PREMIX = "source.torch_matmul_1.output"
    PREMIX_HEADS_FIRST = True

    def interior_reason(self) -> str | None:
        return None  # one code path whatever the attention implementation

    attention_output = Value("../resid_attn_dropout.output", description="What the attention adds to the stream")
    # ``.reshape(...).transpose(1, 2)``: the transposes give the heads as the score product uses them.
    attention_queries = _value("transpose_0.output", "attention_queries")
    attention_keys = _value("transpose_1.output", "attention_keys")
    attention_values = _value("transpose_2.output", "attention_values")
    attention_scores = _value("nn_functional_softmax_0.input", "attention_scores", 0)
    attention_probabilities = _value("nn_functional_dropout_0.output", "attention_probabilities")


class MptMlp(Mlp):
    mlp_output = Value("source.F_dropout_0.output", description="What the MLP adds: its output before the residual")


Layer, Attention, Mlp = classes(__name__, attention=MptAttention, mlp=MptMlp)
ENVOYS = {hf.MptBlock: Layer, hf.MptAttention: Attention, hf.MptMLP: Mlp}


def intermediate_size(model: Any) -> int:
    """The MLP is four times the hidden size (the module ignores ``expansion_ratio``)."""
    return 4 * model.hidden_size
