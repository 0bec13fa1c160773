"""The standardized values on vLLM's module tree.

vLLM keeps every activation flat, ``[tokens, ...]`` for all requests in a step (nnsight
narrows it to one invoke's tokens), splits the residual stream of llama-like blocks into
``(hidden, residual)`` whose sum is the stream, runs attention in fused kernels, and
reuses its buffers in place. So here every value is served as ``[1, seq, ...]`` (one
prompt per invoke), always as a copy, and written back by assignment: an in-place edit of
the copy is written back when the worker moves on, as an assignment would be.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from nnsight.intervention.envoy import Envoy

from .attention import HeadOutputs
from .layer import Layer as BaseLayer
from .mlp import Mlp as BaseMlp
from .standard import Standard
from .values import Delegate, Value, unavailable

FUSED = (
    "vLLM computes the attention pattern inside its fused attention kernel and never materializes it; "
    "read attention_queries and attention_keys (softmax(q k^T * scale) under the causal mask), "
    "or use StandardizedTransformer for the pattern"
)


def batched(flat: torch.Tensor) -> torch.Tensor:
    """``[tokens, ...]`` -> a copy shaped ``[1, tokens, ...]``."""
    return flat.unsqueeze(0).clone()


def flat(value: torch.Tensor, name: str) -> torch.Tensor:
    """``[1, tokens, ...]`` -> ``[tokens, ...]``, a copy (vLLM's kernels edit their inputs in place)."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] != 1:
        shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name}: vLLM serves one prompt per invoke; write a [1, seq, ...] tensor, got {shape}")
    return value[0].clone()


class Flat(Value):
    """A value vLLM holds as ``[tokens, ...]``: served as a ``[1, tokens, ...]`` copy, written back by assignment."""

    writes_back = True

    def serve(self, host: Envoy, part: Any) -> Any:
        return super().serve(host, batched(part))

    def accept(self, host: Envoy, value: Any) -> Any:
        return flat(super().accept(host, value), self.name)

    def with_added(self, output: Any, delta: torch.Tensor) -> Any:
        """A raw output of the module this value is the output of, with ``delta`` (``[tokens, hidden]``)
        added to the value; pure tensor code, so it runs inside vLLM's compiled graph."""
        return self.put("output", output, self.pick("output", output, self.select) + delta, self.select)


def tensor_parallel() -> tuple[int, int]:
    """``(world size, rank)`` of the tensor-parallel group this code runs in (inside a trace, on a worker)."""
    from vllm.distributed import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def gathered(local: torch.Tensor) -> torch.Tensor:
    """Every tensor-parallel rank's slice of the last axis, concatenated in rank order (on one rank: itself)."""
    size, _ = tensor_parallel()
    if size == 1:
        return local
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(local.contiguous(), dim=-1)


class Heads(Flat):
    """A per-head value of which each tensor-parallel rank holds its own heads: gathered on read, cut on write."""

    def serve(self, host: Envoy, part: Any) -> Any:
        return super().serve(host, gathered(part))

    def accept(self, host: Envoy, value: Any) -> Any:
        whole = super().accept(host, value)
        size, rank = tensor_parallel()
        return whole if size == 1 else whole.chunk(size, dim=-1)[rank].clone()


def kv_split_reason(attention: Envoy) -> str | None:
    """Why keys and values cannot be gathered whole: fewer key/value heads than tensor-parallel ranks."""
    size = attention.root._tensor_parallel_size
    heads = attention.root.num_kv_heads
    if heads % size:
        return f"{heads} key/value heads are replicated, not split, over {size} tensor-parallel ranks"
    return None


def heads_first(host: Envoy, value: torch.Tensor) -> torch.Tensor:
    """``[1, tokens, heads * head_dim]`` -> ``[1, heads, tokens, head_dim]``."""
    head_dim = host.head_size
    return value.view(*value.shape[:2], -1, head_dim).transpose(1, 2)


def heads_merged(host: Envoy, value: torch.Tensor) -> torch.Tensor:
    """The inverse of `heads_first`."""
    return value.transpose(1, 2).reshape(*value.shape[:1], value.shape[2], -1)


def forward_parameters(envoy: Envoy) -> list[str]:
    """The names of the parameters of an envoy's module's forward, in order (``self`` left out)."""
    return [name for name in inspect.signature(type(envoy._module).forward).parameters if name != "self"]


def stream_arguments(layer: Envoy) -> tuple[tuple[int, str], tuple[int, str]]:
    """Where a block's forward takes ``hidden_states`` and ``residual``: ``((position, name), ...)``."""
    names = forward_parameters(layer)
    return tuple((names.index(name), name) for name in ("hidden_states", "residual"))


def hidden_states_argument(envoy: Envoy) -> tuple[int, str]:
    """Where a module's forward takes ``hidden_states``: ``(position, name)``."""
    return forward_parameters(envoy).index("hidden_states"), "hidden_states"


def _no_hidden_states(envoy: Envoy) -> str | None:
    if "hidden_states" not in forward_parameters(envoy):
        return f"{type(envoy._module).__name__}.forward takes no hidden_states argument"
    return None


def _argument(call: tuple, where: tuple[int, str]) -> Any:
    args, kwargs = call
    position, name = where
    return args[position] if position < len(args) else kwargs.get(name)


def _with_argument(call: tuple, where: tuple[int, str], value: Any) -> tuple:
    args, kwargs = call
    position, name = where
    if position < len(args):
        return (*args[:position], value, *args[position + 1 :]), kwargs
    return args, {**kwargs, name: value}


class Argument(Flat):
    """One argument of a module's call, where ``select`` (``(position, name)``) says it is passed by
    position or by name."""

    def pick(self, attribute: str, raw: Any, select: Any) -> Any:
        return _argument(raw, select)

    def put(self, attribute: str, current: Any, part: Any, select: Any) -> Any:
        return _with_argument(current, select, part)


class DualStream(Flat):
    """The residual stream of a block that passes ``(hidden, residual)``: the stream is their sum.

    Read: ``hidden + residual`` (``hidden`` alone where ``residual`` is ``None``, on the first
    block). Written: the stream goes in as ``hidden`` beside a zero ``residual`` (so whatever
    sums them next sees exactly the written stream), or alone where ``residual`` was ``None``.
    """

    def pick(self, attribute: str, raw: Any, select: Any) -> Any:
        if attribute == "output":
            hidden, residual = raw[0], raw[1]
        else:
            hidden, residual = (_argument(raw, where) for where in select)
        return hidden if residual is None else hidden + residual

    def with_added(self, output: Any, delta: torch.Tensor) -> Any:
        """``(hidden, residual)`` with ``delta`` added to the stream: to the residual (or to ``hidden`` alone)."""
        hidden, residual = output[0], output[1]
        if residual is None:
            return (hidden + delta, None, *output[2:])
        return (hidden, residual + delta, *output[2:])

    def put(self, attribute: str, current: Any, part: Any, select: Any) -> Any:
        if attribute == "output":
            return (part, torch.zeros_like(part), *current[2:])
        hidden_at, residual_at = select
        current = _with_argument(current, hidden_at, part)
        residual = _argument(current, residual_at)
        return current if residual is None else _with_argument(current, residual_at, torch.zeros_like(residual))


class Layer(Standard):
    """A vLLM decoder block whose stream is one tensor (GPT-2)."""

    layer_input = Flat("input", description="The residual stream entering the block [1, seq, hidden]")
    layer_output = Flat("output", description="The residual stream leaving the block [1, seq, hidden]")
    attention_output = Delegate(
        "self_attn", "attention_output", description="What the attention sublayer adds to the residual stream"
    )
    mlp_output = Delegate("mlp", "mlp_output", description="What the MLP sublayer adds to the residual stream")
    mixer_output = BaseLayer.mixer_output


class DualStreamLayer(Layer):
    """A vLLM decoder block passing ``(hidden, residual)`` (llama-like): the stream is their sum."""

    layer_input = DualStream(
        "inputs", select=stream_arguments, description="The residual stream entering the block [1, seq, hidden]"
    )
    layer_output = DualStream(
        "output", select=stream_arguments, description="The residual stream leaving the block [1, seq, hidden]"
    )


class Attention(Standard):
    """A vLLM attention module: projections around one fused attention kernel (``attn``)."""

    #: The fused attention layer receiving ``(q, k, v)`` after rotary and returning the premix.
    KERNEL = "attn"
    OUTPUT_PROJECTION = "o_proj"

    @property
    def head_size(self) -> int:
        """The width of one head, as the kernel is configured."""
        return getattr(self, self.KERNEL)._module.head_size

    @property
    def output_projection(self) -> Envoy:
        """The envoy of the output projection."""
        return getattr(self, self.OUTPUT_PROJECTION)

    _projection_output = Flat("{self.OUTPUT_PROJECTION}.output")

    attention_output = Flat("output", description="The attention module's output [1, seq, hidden]")
    attention_input = Argument(
        "inputs",
        select=hidden_states_argument,
        description="The hidden states the attention module reads [1, seq, hidden]",
        unavailable=_no_hidden_states,
    )

    @Heads("{self.KERNEL}.inputs", select=0, description="Queries after rotary [1, heads, seq, head_dim]")
    def attention_queries(self, value: Any) -> Any:
        """The queries entering the attention kernel, after any rotary embedding."""
        return heads_first(self, value)

    @Heads(
        "{self.KERNEL}.inputs",
        select=1,
        description="Keys after rotary [1, kv_heads, seq, head_dim]",
        unavailable=kv_split_reason,
    )
    def attention_keys(self, value: Any) -> Any:
        """The keys entering the attention kernel, before grouped-query repetition."""
        return heads_first(self, value)

    @Heads(
        "{self.KERNEL}.inputs", select=2, description="Values [1, kv_heads, seq, head_dim]", unavailable=kv_split_reason
    )
    def attention_values(self, value: Any) -> Any:
        """The values entering the attention kernel, before grouped-query repetition."""
        return heads_first(self, value)

    @Heads("{self.KERNEL}.output", description="Per-head mixed values [1, seq, heads, head_dim]")
    def attention_premix(self, value: Any) -> Any:
        """Each head's mix of the values, before the output projection."""
        return value.view(*value.shape[:2], -1, self.head_size)

    @attention_premix.postprocess
    def attention_premix(self, value: Any) -> Any:
        return value.reshape(*value.shape[:2], -1)

    attention_head_outputs = HeadOutputs(
        description="Each head's contribution after the output projection [1, seq, heads, hidden]"
    )
    attention_scores = unavailable(FUSED)
    attention_probabilities = unavailable(FUSED)


for _name in ("attention_queries", "attention_keys", "attention_values"):
    getattr(Attention, _name).postprocess(heads_merged)


class Mlp(BaseMlp):
    """A vLLM dense MLP (no router); `SparseMlp` serves a mixture of experts."""

    mlp_output = Flat("output", description="What the MLP adds to the residual stream [1, seq, hidden]")
    mlp_input = Flat("input", description="The hidden states the MLP reads [1, seq, hidden]")


FUSED_MOE = (
    "vLLM chooses each token's experts inside its fused MoE kernel, from router_logits, and hands the choice "
    "to no module; read router_logits (its top-k, after the family's scoring, are the choices)"
)


def _fused_choice(mlp: Envoy) -> str:
    return BaseMlp.router_logits.unavailable(mlp) or FUSED_MOE


class SparseMlp(Mlp):
    """A vLLM mixture-of-experts block: the router's logits are a module output; the expert choice is fused."""

    ROUTER = "gate"

    def _watch_tokens(self) -> None:
        """vLLM's tokens are flat already: nothing to record."""

    router_logits = Flat(
        "{self.ROUTER}.output",
        select=0,
        description=BaseMlp.router_logits.description,
        unavailable=BaseMlp.router_logits.unavailable,
    )
    expert_indices = Value(description=BaseMlp.expert_indices.description, unavailable=_fused_choice)
    expert_weights = Value(description=BaseMlp.expert_weights.description, unavailable=_fused_choice)


__all__ = ["FUSED", "FUSED_MOE", "Attention", "DualStream", "DualStreamLayer", "Flat", "Layer", "Mlp", "SparseMlp"]
