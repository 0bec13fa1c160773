"""vLLM's attention module: its standardized values, around one fused kernel that never materializes the pattern.

Each tensor-parallel rank holds its own heads: the per-head values are gathered on read and cut back on write. The
pattern is rebuilt, when read, from the queries and keys the kernel receives, with the kernel's own rule.
"""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.interleaver import Mediator

from ..errors import UnavailableValue
from .attention import HeadOutputs
from .standard import Standard
from .values import NNSIGHT_ONLY, WHOLE, Value
from .vllm import Argument, Copied, Flat, forward_parameters, gathered, hidden_states_argument, tensor_parallel

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


def _no_hidden_states(envoy: Envoy) -> str | None:
    if "hidden_states" not in forward_parameters(envoy):
        return f"{type(envoy._module).__name__}.forward takes no hidden_states argument"
    return None


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
    from .kv_cache import unreadable_reason

    reason = unreadable_reason(getattr(attention._module, attention.KERNEL))
    return None if reason is None else f"{GENERATED_STEP}: {reason}"


def earlier_keys(attention: Envoy, location: str) -> torch.Tensor | None:
    """The keys of the invoke's tokens before this step that its tokens attend to, from vLLM's KV cache (``None``
    on its first step): all of them, or on a sliding-window layer the last ``window - 1`` (what transformers'
    sliding-window cache hands such a layer, so the pattern has the same columns on both engines)."""
    from vllm.forward_context import get_forward_context

    from . import kv_cache

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
    attend to, the earlier tokens' keys read back from the request's KV cache (`nnterp_vllm.components.kv_cache`).
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


__all__ = [
    "GENERATED_STEP",
    "PATTERN_WRITE",
    "Attention",
    "Pattern",
    "TransformersAttention",
]
