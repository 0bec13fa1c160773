"""The standardized values on vLLM's module tree.

vLLM keeps every activation flat, ``[tokens, ...]`` for all requests in a step (nnsight
narrows it to one invoke's tokens), splits the residual stream of llama-like blocks into
``(hidden, residual)`` whose sum is the stream, runs attention in fused kernels, and
reuses its buffers in place. So here every value is served as ``[1, seq, ...]`` (one
prompt per invoke), always as a copy, and written back by assignment: an in-place edit of
the copy is written back when the worker moves on, as an assignment would be.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.interleaver import Mediator

from ..errors import UnavailableValue
from .layer import Layer as BaseLayer
from .mixer import Mixer as BaseMixer
from .mlp import Mlp as BaseMlp
from .mlp import PerToken
from .standard import Standard
from .values import NNSIGHT_ONLY, WHOLE, Delegate, Scaled, Value

#: Why the expert choice cannot be written on vLLM.
CHOICE_WRITE = (
    "vLLM's fused MoE kernel chooses the experts from router_logits itself and never reads a choice from a "
    "module, so it cannot be rerouted; write router_logits to change the choice (or use StandardizedTransformer)"
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


class FlatScaled(Flat, Scaled):
    """A flat value times a factor (`Scaled`): what a block adds where it scales a sublayer's output first."""


class _Part(Flat):
    """One module output a `Summed` value adds up (read as a copy; nothing written back)."""

    writes_back = False


class Summed(Value):
    """What a block adds as a sum it computes inline from module outputs, each times a factor: read-only.

    ``parts`` are ``(key, scale)`` pairs, in forward order (or a function of the block returning them): a module
    output relative to the block and the block attribute (or function of the block) holding its factor, or
    ``None``. The sum is an expression in the block's forward that no module returns, so it can be read but not
    written; write its parts' modules instead.
    """

    def __init__(self, *parts: Any, description: str = "", unavailable: Any = None) -> None:
        super().__init__(description=description, unavailable=unavailable, writable=False)
        self.parts = parts[0] if len(parts) == 1 and callable(parts[0]) else parts

    def read(self, host: Envoy) -> Any:
        self.check(host)
        total = 0
        for key, scale in self.parts(host) if callable(self.parts) else self.parts:
            factor = 1 if scale is None else scale(host) if callable(scale) else getattr(host._module, scale)
            total = total + _part(key).read(host) * factor
        return total


@functools.cache
def _part(key: str) -> _Part:
    part = _Part(key)
    part.name = key
    return part


def one_prompt(value: Any, name: str) -> torch.Tensor:
    """A written ``[1, seq, ...]`` tensor, as a copy; anything else is refused naming the shape wanted."""
    return flat(value, name).unsqueeze(0)


def on_transformers_backend(host: Envoy) -> bool:
    """Whether the model runs on vLLM's Transformers backend: transformers' own modules, fed ``[1, tokens, ...]``.

    vLLM serves an architecture it has no model code of its own for by running transformers' modules (with its
    linears, norms and attention kernel swapped in) over the flat batch given a leading axis of one.
    """
    from vllm.model_executor.models.transformers.base import Base

    return isinstance(host.root._module, Base)


class Copied(Value):
    """A value vLLM already holds as ``[1, tokens, ...]`` (a transformers module's, on the Transformers backend):
    served as a copy, written back by assignment."""

    writes_back = True

    def serve(self, host: Envoy, part: Any) -> Any:
        return super().serve(host, part.clone())

    def accept(self, host: Envoy, value: Any) -> Any:
        return one_prompt(super().accept(host, value), self.name)

    def flat_part(self, host: Envoy) -> Any:
        return _without_batch_axis(super().flat_part(host))


class Hidden(Flat):
    """A value at a module around the blocks (the embeddings, the final norm): flat where vLLM runs its own model
    code, ``[1, tokens, ...]`` where it runs transformers' modules on its Transformers backend."""

    def serve(self, host: Envoy, part: Any) -> Any:
        if on_transformers_backend(host):
            return Value.serve(self, host, part.clone())
        return super().serve(host, part)

    def accept(self, host: Envoy, value: Any) -> Any:
        if on_transformers_backend(host):
            return one_prompt(Value.accept(self, host, value), self.name)
        return super().accept(host, value)

    def flat_part(self, host: Envoy) -> Any:
        flat = super().flat_part(host)
        return _without_batch_axis(flat) if on_transformers_backend(host) else flat


def _without_batch_axis(flat: Any) -> Any:
    """``flat`` (a reader of ``[1, tokens, ...]``) reading ``[tokens, ...]``; a reason stays a reason."""
    return flat if isinstance(flat, str) else lambda part: flat(part)[0]


@functools.cache
def _copied_class(kind: type) -> type:
    cls = type(f"Copied{kind.__name__}", (Copied, kind), {"__module__": __name__})
    globals()[cls.__name__] = cls  # found by name when a model pickles into vLLM's workers
    return cls


def _routed_in_kernel(mlp: Envoy) -> str | None:
    """Why the backend serves no expert choice: it replaced the MoE block's routing with its fused kernel's."""
    from vllm.model_executor.models.transformers.moe import TransformersMoERunner

    experts = getattr(mlp._module, mlp.EXPERTS, None)
    return None if experts is None or isinstance(experts, TransformersMoERunner) else FUSED_MOE


def copied(value: Value) -> Value:
    """``value`` (a transformers family's) as served on the Transformers backend: the same location, read as a copy.

    A routing value the MoE block holds as ``[tokens, ...]`` over the whole batch stays flat there, as on vLLM's
    own model code; the expert choice is served where the backend leaves the routing to transformers' module, which
    hands the choice to the experts (vLLM's kernel then runs them).
    """
    kind = type(value)
    if issubclass(kind, Flat) or type(value).read is not Value.read:
        return value  # already vLLM's, or computed from other values
    cls = Flat if issubclass(kind, PerToken) else _copied_class(kind)
    served = cls.__new__(cls)
    property.__init__(served)
    served.__dict__.update(value.__dict__)
    if value.name in ("expert_indices", "expert_weights"):
        rebuilt = ExpertChoice(value.name == "expert_weights", ExpertChoice.DESCRIPTIONS[value.name])
        rebuilt.name = value.name
        return RoutedEither(served, rebuilt)
    return served


class RoutedEither(Value):
    """An expert-choice value on the Transformers backend: transformers' own (``external``) where the backend leaves
    the routing to transformers' module, which hands the choice to the experts; the choice rebuilt by the fused
    kernel's router (``internal``, an `ExpertChoice`) where the backend moved the routing into that kernel."""

    def __init__(self, external: Value, internal: Value) -> None:
        super().__init__(external.key, select=external.select, description=external.description)
        self.name = external.name
        self.external, self.internal = external, internal

    def chosen(self, host: Envoy) -> Value:
        """The value in force on ``host``."""
        return self.internal if _routed_in_kernel(host) else self.external

    def reason(self, host: Envoy) -> str | None:
        return self.chosen(host).reason(host)

    def located(self, host: Envoy) -> Any:
        return self.chosen(host).located(host)

    def read(self, host: Envoy) -> Any:
        return self.chosen(host).read(host)

    def __set__(self, host: Envoy, value: Any) -> None:
        self.chosen(host).__set__(host, value)


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
    """A vLLM decoder block whose stream is one tensor: its ``hidden_states`` argument in, its output (or the
    output's first element, beside a residual the next block does not read) out (GPT-2, GPT-J, Cohere, StableLM)."""

    layer_input = Argument(
        "inputs", select=hidden_states_argument, description="The residual stream entering the block [1, seq, hidden]"
    )
    layer_output = Flat("output", description="The residual stream leaving the block [1, seq, hidden]")
    attention_output = Delegate(
        "self_attn", "attention_output", description="What the attention sublayer adds to the residual stream"
    )
    mlp_output = Delegate("mlp", "mlp_output", description="What the MLP sublayer adds to the residual stream")
    mixer_output = BaseLayer.mixer_output
    sae_features = BaseLayer.sae_features


class DualStreamLayer(Layer):
    """A vLLM decoder block passing ``(hidden, residual)`` (llama-like): the stream is their sum."""

    layer_input = DualStream(
        "inputs", select=stream_arguments, description="The residual stream entering the block [1, seq, hidden]"
    )
    layer_output = DualStream(
        "output", select=stream_arguments, description="The residual stream leaving the block [1, seq, hidden]"
    )


class Mlp(BaseMlp):
    """A vLLM dense MLP (no router); `SparseMlp` serves a mixture of experts."""

    mlp_output = Flat("output", description="What the MLP adds to the residual stream [1, seq, hidden]")
    mlp_input = Flat("input", description="The hidden states the MLP reads [1, seq, hidden]")


class Mixer(BaseMixer):
    """A vLLM token mixer other than attention (a mamba scan, a short convolution) in a block's ``mixer`` slot."""

    mixer_output = Flat("output", description=BaseMixer.mixer_output.description)


FUSED_MOE = (
    "vLLM chooses each token's experts inside its fused MoE kernel, from router_logits, and hands the choice "
    "to no module; read router_logits (its top-k, after the family's scoring, are the choices)"
)


def moe_runner(mlp: Envoy) -> Any:
    """The MoE block's vLLM experts runner (``EXPERTS``, else the one runner among its modules), or ``None``."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface

    named = getattr(mlp._module, mlp.EXPERTS, None)
    if isinstance(named, MoERunnerInterface):
        return named
    found = [module for module in mlp._module.modules() if isinstance(module, MoERunnerInterface)]
    return found[0] if len(found) == 1 else None


def _choice_reason(mlp: Envoy) -> str | None:
    """Why the expert choice cannot be rebuilt from the router's logits with the kernel's own router, or ``None``."""
    reason = type(mlp).router_logits.reason(mlp)
    if reason:
        return reason
    runner = moe_runner(mlp)
    if runner is None:
        return FUSED_MOE + "; no vLLM experts runner was found in this block to route with"
    if not callable(getattr(getattr(runner, "router", None), "_compute_routing", None)):
        kind = type(getattr(runner, "router", None)).__name__
        return FUSED_MOE + f"; its runner's router ({kind}) is not one to call"
    return None


class ExpertChoice(Value):
    """The experts vLLM's fused MoE kernel routes each token to (or their weights), rebuilt from the served router
    logits by the kernel's own router (``runner.router``: its scoring, correction bias, grouped top-k,
    renormalization), times the routed scaling factor the runner applies to the output: ``[1, seq, k]``, the
    experts in descending weight order. Read-only (`CHOICE_WRITE`); nothing is computed unless it is read."""

    DESCRIPTIONS = {
        "expert_indices": "The experts each token is routed to, rebuilt by vLLM's router [1, seq, k] (read-only)",
        "expert_weights": "The chosen experts' mixing weights, rebuilt by vLLM's router [1, seq, k] (read-only)",
    }

    def __init__(self, weights: bool, description: str) -> None:
        super().__init__(
            "{self.ROUTER}.output", select=WHOLE, description=description, unavailable=_choice_reason, writable=False
        )
        self.weights = weights

    def flat_part(self, host: Envoy) -> Any:
        return NNSIGHT_ONLY

    def read(self, host: Envoy) -> Any:
        self.check(host)
        served = type(host).router_logits
        location, attribute = served.locate(host)
        logits = served.pick(attribute, Mediator.value(location), served.selection(host))
        runner = moe_runner(host)
        weights, indices = runner.router._compute_routing(logits, logits, None)
        scale = float(getattr(runner, "routed_scaling_factor", 1.0) or 1.0)
        weights = weights.float() * scale if scale != 1.0 else weights.float()
        weights, order = weights.sort(dim=-1, descending=True)
        indices = indices.long().gather(-1, order)
        return (weights.to(logits.dtype) if self.weights else indices).unsqueeze(0).clone()

    def __set__(self, host: Envoy, value: Any) -> None:
        raise UnavailableValue(f"{self.name} cannot be written on {host.path}: {CHOICE_WRITE}")


class SparseMlp(Mlp):
    """A vLLM mixture-of-experts block: the router's logits are a module output; the expert choice is fused."""

    ROUTER = "gate"

    def _watch_tokens(self) -> None:
        """vLLM's tokens are flat already: nothing to record."""

    router_logits = Flat(
        "{self.ROUTER}.output",
        description=BaseMlp.router_logits.description,
        unavailable=BaseMlp.router_logits.unavailable,
    )
    expert_indices = ExpertChoice(False, ExpertChoice.DESCRIPTIONS["expert_indices"])
    expert_weights = ExpertChoice(True, ExpertChoice.DESCRIPTIONS["expert_weights"])


__all__ = [
    "CHOICE_WRITE",
    "FUSED_MOE",
    "Argument",
    "Copied",
    "DualStream",
    "DualStreamLayer",
    "ExpertChoice",
    "Flat",
    "FlatScaled",
    "Hidden",
    "Layer",
    "Mixer",
    "Mlp",
    "RoutedEither",
    "SparseMlp",
    "Summed",
    "copied",
    "on_transformers_backend",
]
