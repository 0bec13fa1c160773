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
from .attention import HeadOutputs
from .layer import Layer as BaseLayer
from .mixer import Mixer as BaseMixer
from .mlp import Mlp as BaseMlp
from .mlp import PerToken
from .standard import Standard
from .values import NNSIGHT_ONLY, WHOLE, Delegate, Scaled, Value

FUSED = (
    "vLLM computes the attention pattern inside its fused attention kernel and never materializes it; "
    "read attention_queries and attention_keys (softmax(q k^T * scale) under the causal mask), "
    "or use StandardizedTransformer for the pattern"
)
#: Why the rebuilt pattern is not served at a step after a request's first, before the backend's own reason.
GENERATED_STEP = (
    "after a request's first step vLLM's kernel reads the earlier tokens' keys from its paged KV cache, and "
    "they cannot be read back from this cache"
)
#: Why the pattern cannot be written on vLLM.
PATTERN_WRITE = (
    "vLLM's fused attention kernel computes the pattern from the queries and keys and never reads it from a "
    "module, so it cannot be written; write attention_queries or attention_keys (or use StandardizedTransformer)"
)
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


def _kernel_rule_reason(attention: Envoy) -> str | None:
    """Why the pattern cannot be rebuilt from the kernel's queries and keys with the kernel's own rule, or ``None``.

    The rule is read off vLLM's attention layer (``attn``) and its backend implementation (``attn.impl``): the
    scale, the logit soft-cap, the sliding window, ALiBi slopes; what they do not say (a latent or non-causal
    attention) is refused with its reason. Attention sinks change the attention's output, not the pattern: the
    pattern stays the softmax over the keys, as transformers' eager attention returns it for the families that
    serve it (a family whose transformers pattern counts the sink says so itself).
    """
    from vllm.model_executor.layers.attention.attention import Attention as VLLMAttention

    kernel = getattr(attention._module, attention.KERNEL, None)
    if not isinstance(kernel, VLLMAttention):
        return f"its kernel is {type(kernel).__name__}, not vLLM's softmax Attention over per-head queries and keys"
    impl = getattr(kernel, "impl", None)
    if impl is None or not isinstance(getattr(impl, "scale", None), (int, float)):
        return "vLLM's attention backend here holds no softmax scale to rebuild the scores with"
    if getattr(kernel, "use_alibi_sqrt", False):
        return "its kernel scales an ALiBi bias by the square root of the distance, a rule not rebuilt here"
    kind = str(getattr(kernel, "attn_type", "decoder")).lower()
    if "decoder" not in kind or "encoder" in kind:
        return f"its kernel runs {kind} attention (not causal self-attention over the prompt)"
    return None


def _pattern_reason(attention: Envoy) -> str | None:
    """Why the pattern cannot be rebuilt: the kernel does not receive per-head queries and keys, or its rule is not
    rebuilt. A family whose queries differ from transformers' only by where a scale is applied (the kernel's
    inputs, not the standardized queries) still serves the pattern; one whose pattern is not transformers' for a
    reason of its own declares the pattern unavailable itself."""
    return (
        Attention.attention_queries.reason(attention)
        or Attention.attention_keys.reason(attention)
        or _kernel_rule_reason(attention)
    )


def _window(kernel: torch.nn.Module) -> int | None:
    """The kernel's sliding window (how many keys back a query sees, itself included), or ``None``."""
    window = getattr(kernel, "sliding_window", None)
    if isinstance(window, (tuple, list)):  # some backends keep (left, right)
        window = window[0] + 1 if window[0] >= 0 else None
    return window if isinstance(window, int) and window > 0 else None


def rebuilt_scores(
    attention: Envoy, queries: torch.Tensor, keys: torch.Tensor, earlier: torch.Tensor | None = None
) -> torch.Tensor:
    """``[1, heads, new, earlier + new]`` scores of a step's ``new`` tokens from the kernel's flat
    ``[new, heads * head_dim]`` queries and ``[new, kv_heads * head_dim]`` keys, after the keys of the ``earlier``
    tokens they attend to (``[earlier, kv_heads * head_dim]``, read back from the KV cache; none on a prompt's first
    step), with the kernel's rule: scaled, soft-capped, an ALiBi bias added, masked (causal, sliding window) the way
    transformers' eager attention masks, by adding the dtype's minimum at hidden positions."""
    kernel = getattr(attention._module, attention.KERNEL)
    impl = kernel.impl
    head_dim = attention.head_size
    dtype = queries.dtype
    if earlier is not None:
        keys = torch.cat([earlier.to(keys.dtype), keys])
    positions = torch.arange(keys.shape[0], device=queries.device)
    back = positions[keys.shape[0] - queries.shape[0] :].view(-1, 1) - positions.view(1, -1)
    visible = back >= 0
    window = _window(kernel)
    if window is not None:
        visible &= back < window
    q = queries.reshape(queries.shape[0], -1, head_dim).transpose(0, 1).float()
    k = keys.reshape(keys.shape[0], -1, head_dim).transpose(0, 1).float()
    k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)  # grouped-query heads expanded
    scores = torch.matmul(q, k.transpose(1, 2)) * float(impl.scale)
    cap = getattr(impl, "logits_soft_cap", None)
    if cap:
        scores = torch.tanh(scores / cap) * cap
    slopes = getattr(impl, "alibi_slopes", None)
    if slopes is not None:  # by key position, as transformers' ALiBi families add it (softmax-equal to vLLM's)
        scores = scores + gathered(slopes.float().to(scores.device)).view(-1, 1, 1) * positions.float()
    scores = scores.to(dtype)
    hidden = torch.zeros((), dtype=dtype, device=scores.device) + torch.finfo(dtype).min
    mask = torch.where(visible, torch.zeros((), dtype=dtype, device=scores.device), hidden)
    return (scores + mask).unsqueeze(0)


def _step_reason(attention: Envoy) -> str | None:
    """Why the pattern cannot be served at a step after a request's first (its earlier keys are in the cache)."""
    from ..engines.kv_cache import unreadable_reason

    reason = unreadable_reason(getattr(attention._module, attention.KERNEL))
    return None if reason is None else f"{GENERATED_STEP}: {reason}"


def earlier_keys(attention: Envoy, location: str) -> torch.Tensor | None:
    """The keys of the invoke's tokens before this step that its tokens attend to, from vLLM's KV cache (``None``
    on its first step): all of them, or on a sliding-window layer the last ``window - 1`` (what transformers'
    sliding-window cache hands such a layer, so the pattern has the same columns on both engines)."""
    from vllm.forward_context import get_forward_context

    from ..engines import kv_cache

    mediator = Mediator.current(location)
    kernel = getattr(attention._module, attention.KERNEL)
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0]
    if isinstance(metadata, dict):
        metadata = metadata[kernel.layer_name]
    window = _window(kernel)  # a window's layer attends to its last window - 1 earlier keys, as transformers' cache
    try:
        if not kv_cache.earlier_tokens(metadata, mediator.row, mediator.batch_group[0]):
            return None
        reason = _step_reason(attention)
        if reason is not None:
            raise RuntimeError(reason)
        return kv_cache.earlier_keys(
            kernel, metadata, mediator.row, mediator.batch_group[0], None if window is None else window - 1
        )
    except RuntimeError as error:
        raise UnavailableValue(f"the pattern is not available on {attention.path} at this step: {error}") from None


class Pattern(Value):
    """The attention pattern vLLM's fused kernel never materializes, rebuilt from the queries and keys it received.

    Read where the kernel is called (``{self.KERNEL}.inputs``), at any step: the rows of the step's tokens (the
    prompt's at a trace or a generation's first step; one row per generated token after it) over every key they
    attend to, the earlier tokens' keys read back from the request's KV cache (`nnterp_vllm.engines.kv_cache`).
    A write is refused (`PATTERN_WRITE`). Nothing is computed unless the value is read.
    """

    def __init__(self, probabilities: bool, description: str) -> None:
        super().__init__("{self.KERNEL}.inputs", select=WHOLE, description=description, unavailable=_pattern_reason)
        self.probabilities = probabilities

    def flat_part(self, host: Envoy) -> Any:
        return NNSIGHT_ONLY

    def read(self, host: Envoy) -> Any:
        self.check(host)
        location, _ = self.locate(host)
        args, kwargs = Mediator.value(location)
        queries = args[0] if args else kwargs["query"]
        keys = args[1] if len(args) > 1 else kwargs["key"]
        earlier = earlier_keys(host, location)
        scores = rebuilt_scores(host, gathered(queries), gathered(keys), None if earlier is None else gathered(earlier))
        if not self.probabilities:
            return scores
        return torch.softmax(scores.float(), dim=-1).to(scores.dtype)

    def __set__(self, host: Envoy, value: Any) -> None:
        raise UnavailableValue(f"{self.name} cannot be written on {host.path}: {PATTERN_WRITE}")

    def explain(self, host: Envoy) -> str:
        """How the value is rebuilt on ``host``: where it is read and the kernel's rule."""
        kernel = getattr(host._module, host.KERNEL)
        cap = getattr(kernel.impl, "logits_soft_cap", None) or None
        what = "softmax of the scores" if self.probabilities else "the scores"
        later = _step_reason(host) or "the earlier tokens' keys read back from vLLM's KV cache"
        rule = [f"q k^T * {float(kernel.impl.scale):g}", f"soft-cap {cap}"]
        if getattr(kernel.impl, "alibi_slopes", None) is not None:
            rule.append("ALiBi by key position")
        rule += ["causal mask", f"sliding window {_window(kernel)}", "grouped-query heads expanded"]
        return (
            f"rebuilt when read, as {what}, from the queries and keys vLLM's kernel receives "
            f"({host.path}.{host.KERNEL}.inputs): {', '.join(rule)}; after a request's first step: {later}"
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
        """The envoy of the output projection (``OUTPUT_PROJECTION`` may be a dotted path)."""
        return self.get(self.OUTPUT_PROJECTION)

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
    attention_scores = Pattern(
        False, "Scaled, masked scores, rebuilt from the kernel's queries and keys [1, heads, seq, seq] (read-only)"
    )
    attention_probabilities = Pattern(
        True, "The pattern, rebuilt from the kernel's queries and keys, rows sum to 1 [1, heads, seq, seq] (read-only)"
    )


for _name in ("attention_queries", "attention_keys", "attention_values"):
    getattr(Attention, _name).postprocess(heads_merged)


class TransformersAttention(Attention):
    """A transformers attention module on vLLM's Transformers backend: its own projections, around vLLM's kernel.

    The backend hands the kernel (``attn``) flat queries, keys and values after rotary, as vLLM's own model code
    does; the module's output and its output projection's are ``[1, tokens, hidden]``.
    """

    _projection_output = Copied("{self.OUTPUT_PROJECTION}.output")
    attention_output = Copied("output", description=Attention.attention_output.description)
    attention_input = Copied("input", description=Attention.attention_input.description)


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


def _fused_choice(mlp: Envoy) -> str:
    return BaseMlp.router_logits.unavailable(mlp) or FUSED_MOE


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
    "FUSED",
    "FUSED_MOE",
    "GENERATED_STEP",
    "PATTERN_WRITE",
    "Argument",
    "Attention",
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
    "Pattern",
    "RoutedEither",
    "SparseMlp",
    "Summed",
    "TransformersAttention",
    "copied",
    "on_transformers_backend",
]
