"""XGLM (``XGLMForCausalLM``): ``model.{embed_tokens, layers, layer_norm}``; OPT's block; attention of its own.

The attention flattens batch and heads together (``[batch * heads, ...]``) for its ``torch.bmm`` products, as
BLOOM's does; the values are read there and served per head. Queries come pre-scaled by ``head_dim ** -0.5``.
"""

from typing import Any

import torch
from transformers.models.xglm import modeling_xglm as hf

from ..components import WHOLE, Attention, Layer, Value
from ._layouts import classes

RENAME = {"model.embed_tokens": "embed_tokens", "model.layers": "layers", "model.layer_norm": "norm"}


class XGLMLayer(Layer):
    mlp_output = Value("fc2.output", description=Layer.mlp_output.description)


class Heads(Value):
    """A ``[batch * heads, ...]`` tensor of the attention, served as ``[batch, heads, ...]``."""

    def __init__(self, key: str, base: str, select: Any = WHOLE) -> None:
        super().__init__(f"source.{key}", select=select, description=vars(Attention)[base].description)

    def serve(self, host: Any, part: torch.Tensor) -> torch.Tensor:
        heads = host._module.num_heads
        return super().serve(host, part.view(part.shape[0] // heads, heads, *part.shape[1:]))

    def accept(self, host: Any, value: torch.Tensor) -> torch.Tensor:
        value = super().accept(host, value)
        return value.reshape(-1, *value.shape[2:])


class XGLMAttention(Attention):
    OUTPUT_PROJECTION = "out_proj"

    def interior_reason(self) -> str | None:
        return None  # one code path whatever the attention implementation

    @property
    def SOFTMAX(self) -> str:  # noqa: N802 - read as a key placeholder
        """The softmax call the model's dtype takes (half precision has a branch of its own)."""
        return (
            "nn_functional_softmax_0"
            if self._module.q_proj.weight.dtype == torch.float16
            else "nn_functional_softmax_1"
        )

    attention_queries = Heads("query_states_reshape_0.output", "attention_queries")
    attention_keys = Heads("key_states_reshape_0.output", "attention_keys")
    attention_values = Heads("value_states_reshape_0.output", "attention_values")
    attention_scores = Heads("{self.SOFTMAX}.input", "attention_scores", 0)
    attention_probabilities = Value(
        "source.attn_weights_view_2.output", select=WHOLE, description=Attention.attention_probabilities.description
    )

    @Heads("torch_bmm_1.output", "attention_premix")
    def attention_premix(self, value: Any) -> Any:
        return value.transpose(1, 2)

    @attention_premix.postprocess
    def attention_premix(self, value: Any) -> Any:
        return value.transpose(1, 2)


Layer, Attention, Mlp = classes(__name__, layer=XGLMLayer, attention=XGLMAttention)
ENVOYS = {hf.XGLMDecoderLayer: Layer, hf.XGLMAttention: Attention}


def intermediate_size(model: Any) -> int:
    """The MLP width is ``ffn_dim``."""
    return model.config.ffn_dim
