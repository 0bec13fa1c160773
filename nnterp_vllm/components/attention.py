"""`Attention`: a softmax-attention module, its contribution, its pattern and its interior."""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.interleaver import Mediator

from .standard import Standard
from .values import WHOLE, Value

#: The call every family on transformers' shared attention path makes:
#: ``attention_interface(module, query, key, value, attention_mask, ...)``.
INTERFACE = "attention_interface_1"


def model_config(envoy: Envoy) -> Any:
    """The config of the model an envoy belongs to."""
    return envoy.root._module.config


def needs_eager(envoy: Envoy) -> str | None:
    """Why values read inside the eager attention function are unavailable, or ``None``."""
    implementation = getattr(model_config(envoy), "_attn_implementation", None)
    if implementation not in (None, "eager"):
        return (
            f"read inside the eager attention function, but this model runs {implementation!r} attention; "
            "load it with attn_implementation='eager'"
        )
    return None


def per_head(projection: torch.nn.Module, heads: int, head_dim: int) -> torch.Tensor:
    """An output projection's weight as ``[heads, head_dim, out]``: what each head's slice maps to."""
    weight = projection.weight
    weight_in_out = weight if hasattr(projection, "nf") else weight.t()  # transformers' Conv1D stores [in, out]
    return weight_in_out.reshape(heads, head_dim, weight_in_out.shape[-1])


class HeadOutputs(Value):
    """Each head's contribution after the output projection, ``[batch, seq, heads, out]``.

    Read as the premix pushed through each head's slice of the projection; their sum plus
    the projection's bias is the projection's output. Assigning replaces the projection's
    output with the sum of the assigned heads plus the bias.
    """

    def __get__(self, host: Envoy | None, owner: Any = None) -> Any:
        if host is None:
            return self
        self.check(host)
        premix = host.attention_premix
        weight = per_head(host.output_projection._module, premix.shape[2], premix.shape[3])
        return torch.einsum("bshd,hdm->bshm", premix, weight.to(premix.dtype))

    def __set__(self, host: Envoy, value: Any) -> None:
        self.check(host)
        projection = host.output_projection
        total = value.sum(dim=2)
        bias = getattr(projection._module, "bias", None)
        if bias is not None:
            total = total + bias.to(total.dtype)
        Mediator.swap(f"{projection.path}.output", total)


class Attention(Standard):
    """A softmax-attention module.

    The interior is read around one call, `INTERFACE`, that receives the queries, keys and
    values and returns the per-head mix: transformers' shared ``attention_interface`` on most
    families. A family whose attention does its own arithmetic names its own call and
    operations through the class attributes below.
    """

    #: The call receiving queries, keys and values and returning ``(premix, weights)``.
    INTERFACE = INTERFACE
    #: Positions of queries, keys and values among that call's arguments.
    QKV_ARGS = (1, 2, 3)
    #: Inside that call: the softmax's input (the scores) and the pattern the values are mixed with.
    SCORES = "nn_functional_softmax_0.input"
    PROBABILITIES = "nn_functional_dropout_0.output"
    #: Whether the call returns the premix heads-first, ``[batch, heads, seq, head_dim]``.
    PREMIX_HEADS_FIRST = False
    #: The output projection's name.
    OUTPUT_PROJECTION = "o_proj"

    def interior_reason(self) -> str | None:
        """Why the interior is not served on this module, or ``None``."""
        return needs_eager(self)

    @property
    def output_projection(self) -> Envoy:
        """The envoy of the output projection."""
        return getattr(self, self.OUTPUT_PROJECTION)

    @Value("output", description="The attention module's output [batch, seq, hidden]")
    def attention_output(self, value: Any) -> Any:
        """The attention module's output, a tensor even when the module returns a tuple."""
        return value

    @Value(
        "source.{self.INTERFACE}.inputs",
        select=lambda attention: attention.QKV_ARGS[0],
        description="Queries after rotary [batch, heads, seq, head_dim]",
        unavailable=lambda attention: attention.interior_reason(),
    )
    def attention_queries(self, value: Any) -> Any:
        """The queries as they enter the score product, after any rotary embedding."""
        return value

    @Value(
        "source.{self.INTERFACE}.inputs",
        select=lambda attention: attention.QKV_ARGS[1],
        description="Keys after rotary, before GQA repetition [batch, kv_heads, seq, head_dim]",
        unavailable=lambda attention: attention.interior_reason(),
    )
    def attention_keys(self, value: Any) -> Any:
        """The keys as they enter the score product, before grouped-query repetition."""
        return value

    @Value(
        "source.{self.INTERFACE}.inputs",
        select=lambda attention: attention.QKV_ARGS[2],
        description="Values before GQA repetition [batch, kv_heads, seq, head_dim]",
        unavailable=lambda attention: attention.interior_reason(),
    )
    def attention_values(self, value: Any) -> Any:
        """The values the pattern mixes, before grouped-query repetition."""
        return value

    @Value(
        "source.{self.INTERFACE}.source.{self.SCORES}",
        description="Scaled, masked scores before the softmax [batch, heads, seq, seq]",
        unavailable=lambda attention: attention.interior_reason(),
    )
    def attention_scores(self, value: Any) -> Any:
        """The scaled and masked scores entering the softmax."""
        return value

    @Value(
        "source.{self.INTERFACE}.source.{self.PROBABILITIES}",
        select=WHOLE,
        description="The attention pattern, rows sum to 1 [batch, heads, seq, seq]",
        unavailable=lambda attention: attention.interior_reason(),
    )
    def attention_probabilities(self, value: Any) -> Any:
        """The post-softmax pattern the values are mixed with."""
        return value

    @Value(
        "source.{self.INTERFACE}.output",
        select=0,
        description="Per-head mixed values before the output projection [batch, seq, heads, head_dim]",
        unavailable=lambda attention: attention.interior_reason(),
    )
    def attention_premix(self, value: Any) -> Any:
        """Each head's mix of the values, before the heads are concatenated and projected."""
        return value.transpose(1, 2) if self.PREMIX_HEADS_FIRST else value

    @attention_premix.postprocess
    def attention_premix(self, value: Any) -> Any:
        return value.transpose(1, 2) if self.PREMIX_HEADS_FIRST else value

    attention_head_outputs = HeadOutputs(
        description="Each head's contribution after the output projection [batch, seq, heads, hidden]",
        unavailable=lambda attention: attention.interior_reason(),
    )
