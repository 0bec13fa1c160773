"""`Attention`: a softmax-attention module, its contribution, its pattern and its interior."""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.envoy import Envoy

from .standard import Standard
from .values import FIRST, WHOLE, Value, first_tensor

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


def project(projection: Envoy, value: torch.Tensor) -> torch.Tensor:
    """``value`` (``[..., in]``) through a projection module, called as the forward calls it."""
    flat = value.reshape(-1, value.shape[-1])
    return first_tensor(projection(flat)).reshape(*value.shape[:-1], -1)


class HeadOutputs(Value):
    """Each head's contribution after the output projection, ``[batch, seq, heads, out]``.

    Read by projecting each head's slice of the premix alone (the others zeroed) and taking
    away the projection of zeros (its bias), so the heads sum, with the bias, to the
    projection's output; the projection module itself is called, whatever its weight layout.
    Assigning replaces the projection's output with the assigned heads' sum plus the bias.
    """

    def read(self, host: Envoy) -> Any:
        self.check(host)
        premix = host.attention_premix
        heads = premix.shape[2]
        alone = premix.unsqueeze(0) * torch.eye(heads, dtype=premix.dtype, device=premix.device).view(
            heads, 1, 1, heads, 1
        )
        projected = project(host.output_projection, alone.flatten(-2)) - projection_bias(host)
        return projected.permute(1, 2, 0, 3)

    def __set__(self, host: Envoy, value: Any) -> None:
        self.check(host)
        if not isinstance(value, torch.Tensor) or value.dim() != 4:
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"{host.path}.attention_head_outputs: write a [batch, seq, heads, hidden] tensor, got {shape}"
            )
        host._projection_output = value.sum(dim=2) + projection_bias(host)


def projection_bias(host: Envoy) -> torch.Tensor:
    """What the output projection adds to a zero input (its bias, or zeros), ``[out]``."""
    module = host.output_projection._module
    # torch's Linear, transformers' Conv1D and vLLM's parallel linears name their input width differently.
    width = next(getattr(module, name) for name in ("in_features", "nx", "input_size") if hasattr(module, name))
    parameter = next(module.parameters())
    return project(host.output_projection, torch.zeros(1, width, dtype=parameter.dtype, device=parameter.device))[0]


def interior(key: str, description: str, select: Any = FIRST) -> Value:
    """A value read around the attention's interface call, unavailable where `Attention.interior_reason` says."""
    return Value(key, select=select, description=description, unavailable=lambda attention: attention.interior_reason())


def argument(position: int) -> Any:
    """``select`` for the queries (0), keys (1) or values (2) among the interface call's arguments."""
    return lambda attention: attention.QKV_ARGS[position]


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
    #: Whether the premix is heads-first there, ``[batch, heads, seq, head_dim]``.
    PREMIX_HEADS_FIRST = False
    #: The output projection's name.
    OUTPUT_PROJECTION = "o_proj"

    def interior_reason(self) -> str | None:
        """Why the interior is not served on this module, or ``None``."""
        return needs_eager(self)

    @property
    def PREMIX(self) -> str:  # noqa: N802 - a key placeholder a family may set as a plain string
        """Where the per-head mix is read: the call's output, unless a family names another operation's."""
        return f"source.{self.INTERFACE}.output"

    @property
    def output_projection(self) -> Envoy:
        """The envoy of the output projection."""
        return getattr(self, self.OUTPUT_PROJECTION)

    _projection_output = Value("{self.OUTPUT_PROJECTION}.output")

    @Value("output", description="The attention module's output [batch, seq, hidden]")
    def attention_output(self, value: Any) -> Any:
        """The attention module's output, a tensor even when the module returns a tuple."""
        return value

    attention_input = Value("input", description="The hidden states the attention module reads [batch, seq, hidden]")

    attention_queries = interior(
        "source.{self.INTERFACE}.inputs",
        "Queries as they enter the score product, after rotary [batch, heads, seq, head_dim]",
        select=argument(0),
    )
    attention_keys = interior(
        "source.{self.INTERFACE}.inputs",
        "Keys after rotary, before grouped-query repetition [batch, kv_heads, seq, head_dim]",
        select=argument(1),
    )
    attention_values = interior(
        "source.{self.INTERFACE}.inputs",
        "Values before grouped-query repetition [batch, kv_heads, seq, head_dim]",
        select=argument(2),
    )
    attention_scores = interior(
        "source.{self.INTERFACE}.source.{self.SCORES}",
        "Scaled, masked scores entering the softmax [batch, heads, seq, seq]",
    )
    attention_probabilities = interior(
        "source.{self.INTERFACE}.source.{self.PROBABILITIES}",
        "The pattern the values are mixed with, rows sum to 1 [batch, heads, seq, seq]",
        select=WHOLE,
    )

    @interior("{self.PREMIX}", "Per-head mixed values before the output projection [batch, seq, heads, head_dim]")
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


class GatedAttention(Attention):
    """Attention that changes each head's mix (a gate) between the attention call and the output projection.

    The per-head mix is read, and written, where the projection receives it; `HEAD_WIDTH` names the
    module attribute holding one head's width there.
    """

    #: The module attribute holding one head's width in the premix.
    HEAD_WIDTH = "head_dim"

    @Value(
        "{self.OUTPUT_PROJECTION}.input",
        description="Per-head gated mix of the values entering the output projection [batch, seq, heads, head_dim]",
        unavailable=lambda attention: attention.interior_reason(),
    )
    def attention_premix(self, value: Any) -> Any:
        """Each head's gated mix of the values, before the heads are projected."""
        return value.unflatten(-1, (-1, getattr(self._module, self.HEAD_WIDTH)))

    @attention_premix.postprocess
    def attention_premix(self, value: Any) -> Any:
        return value.flatten(-2)
