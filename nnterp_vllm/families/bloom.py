"""BLOOM (``BloomForCausalLM``): ALiBi attention with arithmetic of its own; both sublayers add the residual inside.

The sublayers' contributions are the first argument of their ``dropout_add`` call.
"""

from typing import Any

from transformers.models.bloom import modeling_bloom as hf

from ..components import WHOLE, Attention, Mlp, Value
from ._layouts import classes

RENAME = {
    "transformer.word_embeddings": "embed_tokens",
    "transformer.h": "layers",
    "transformer.ln_f": "norm",
    "self_attention": "self_attn",
}
CONTRIBUTION = "source.dropout_add_0.input"


def _heads(attention: Any) -> int:
    return attention._module.num_heads


class BloomAttention(Attention):
    OUTPUT_PROJECTION = "dense"
    PROBABILITIES = "self_attention_dropout_0.output"

    def interior_reason(self) -> str | None:
        return None

    attention_output = Value(CONTRIBUTION, description="What the attention adds: the tensor entering dropout_add")
    attention_queries = Value(
        "source.self__reshape_0.output", select=0, description=Attention.attention_queries.description
    )
    attention_keys = Value("source.self__reshape_0.output", select=1, description=Attention.attention_keys.description)
    attention_values = Value(
        "source.self__reshape_0.output", select=2, description=Attention.attention_values.description
    )
    attention_scores = Value("source.F_softmax_0.input", description=Attention.attention_scores.description)
    attention_probabilities = Value(
        "source.{self.PROBABILITIES}", select=WHOLE, description=Attention.attention_probabilities.description
    )

    @Value("source.torch_bmm_0.output", select=WHOLE, description=Attention.attention_premix.description)
    def attention_premix(self, value: Any) -> Any:
        heads = _heads(self)
        return value.view(value.shape[0] // heads, heads, *value.shape[1:]).transpose(1, 2)

    @attention_premix.postprocess
    def attention_premix(self, value: Any) -> Any:
        batch, seq, heads, head_dim = value.shape
        return value.transpose(1, 2).reshape(batch * heads, seq, head_dim)


class BloomMlp(Mlp):
    mlp_output = Value(CONTRIBUTION, description="What the MLP adds: the tensor entering dropout_add")


Layer, Attention, Mlp = classes(__name__, attention=BloomAttention, mlp=BloomMlp)
ENVOYS = {hf.BloomBlock: Layer, hf.BloomAttention: Attention, hf.BloomMLP: Mlp}


def intermediate_size(model: Any) -> int:
    """The MLP is four times the hidden size; the config has no key for it."""
    return 4 * model.hidden_size
