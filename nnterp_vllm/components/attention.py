"""`Attention`: a softmax-attention module, its contribution, its pattern and its interior."""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.envoy import Envoy
from nnsight.modeling.tp import device_mesh, gather, shard

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
        if sharded(host):
            return self.read_sharded(host, premix)
        projected = project(host.output_projection, alone(premix).flatten(-2)) - projection_bias(host)
        return projected.permute(1, 2, 0, 3)

    def read_sharded(self, host: Envoy, premix: torch.Tensor) -> torch.Tensor:
        """Under transformers tensor parallelism: each rank projects its own heads through its own columns of
        the output projection (a row-parallel linear), and the heads are gathered."""
        from torch.distributed.tensor import DTensor

        weight = host.output_projection._module.weight
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        own = alone(shard(host.root, premix, dim=2))
        projected = torch.nn.functional.linear(own.flatten(-2), local.to(own.dtype))
        return gather(host.root, projected.permute(1, 2, 0, 3).contiguous(), dim=2)

    def __set__(self, host: Envoy, value: Any) -> None:
        self.check(host)
        if not isinstance(value, torch.Tensor) or value.dim() != 4:
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"{host.path}.attention_head_outputs: write a [batch, seq, heads, hidden] tensor, got {shape}"
            )
        host._projection_output = value.sum(dim=2) + projection_bias(host)


def alone(premix: torch.Tensor) -> torch.Tensor:
    """``[heads, batch, seq, heads, head_dim]``: for each head, the premix with every other head zeroed."""
    heads = premix.shape[2]
    eye = torch.eye(heads, dtype=premix.dtype, device=premix.device)
    return premix.unsqueeze(0) * eye.view(heads, 1, 1, heads, 1)


def projection_bias(host: Envoy) -> torch.Tensor:
    """What the output projection adds to a zero input (its bias, or zeros), ``[out]``."""
    module = host.output_projection._module
    # torch's Linear, transformers' Conv1D and vLLM's parallel linears name their input width differently.
    width = next(getattr(module, name) for name in ("in_features", "nx", "input_size") if hasattr(module, name))
    parameter = next(module.parameters())
    return project(host.output_projection, torch.zeros(1, width, dtype=parameter.dtype, device=parameter.device))[0]


def sharded(host: Envoy) -> bool:
    """Whether ``host``'s model is split across ranks by transformers tensor parallelism."""
    return device_mesh(host.root) is not None


class Interior(Value):
    """A value read around the attention's interface call, unavailable where `Attention.interior_reason` says.

    Under transformers tensor parallelism each rank computes its own heads there (nnsight makes whole only the
    values at a split module's boundary), so the value is gathered across the tensor-parallel mesh along
    ``axis``, the heads' axis where it is read (a function of the attention envoy, or an int), into a copy whose
    in-place edits are written back; a written value is cut back to the rank's own heads.
    """

    def __init__(self, key: str, description: str, select: Any = FIRST, axis: Any = 1) -> None:
        super().__init__(
            key, select=select, description=description, unavailable=lambda attention: attention.interior_reason()
        )
        self.axis = axis

    def heads_axis(self, host: Envoy) -> int:
        """The heads' axis of the value where it is read on ``host``."""
        return self.axis(host) if callable(self.axis) else self.axis

    def writes_back_on(self, host: Envoy) -> bool:
        return self.writes_back or sharded(host)

    def serve(self, host: Envoy, part: Any) -> Any:
        if sharded(host):
            # A collective's output: cloned so that in-place edits are allowed, and written back.
            part = gather(host.root, part, dim=self.heads_axis(host)).clone()
        return super().serve(host, part)

    def accept(self, host: Envoy, value: Any) -> Any:
        value = super().accept(host, value)
        return shard(host.root, value, dim=self.heads_axis(host)) if sharded(host) else value


def interior(key: str, description: str, select: Any = FIRST, axis: Any = 1) -> Value:
    """An `Interior` value: read around the attention's interface call, its heads on ``axis`` there."""
    return Interior(key, description, select=select, axis=axis)


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

    @interior(
        "{self.PREMIX}",
        "Per-head mixed values before the output projection [batch, seq, heads, head_dim]",
        axis=lambda attention: 1 if attention.PREMIX_HEADS_FIRST else 2,
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
