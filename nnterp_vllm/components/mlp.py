"""`Mlp`: the feed-forward sublayer, dense or a mixture of experts with its router."""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.envoy import Envoy

from .standard import Standard
from .values import FIRST, Value


def _routing_reason(mlp: Envoy, child: str | None, what: str) -> str | None:
    if child is None:
        return f"this family's MLP is dense: it has no {what}"
    if not isinstance(getattr(mlp._module, child, None), torch.nn.Module):
        return f"this block's MLP is dense: it has no {child} module ({what})"
    return None


def _router_reason(mlp: Envoy) -> str | None:
    return _routing_reason(mlp, mlp.ROUTER, "router")


def _experts_reason(mlp: Envoy) -> str | None:
    return _router_reason(mlp) or _routing_reason(mlp, mlp.EXPERTS, "experts module")


def _record_token_shape(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    hidden = args[0] if args else next(iter(kwargs.values()))
    module._nnterp_token_shape = tuple(hidden.shape[:-1])


class PerToken(Value):
    """A routing value the MoE block holds as ``[tokens, ...]`` over the whole batch: served ``[batch, seq, ...]``.

    The batch and sequence sizes are those of the MoE block's input, recorded as it is called.
    """

    def serve(self, host: Envoy, part: Any) -> Any:
        return super().serve(host, part.reshape(*host._module._nnterp_token_shape, -1))

    def accept(self, host: Envoy, value: Any) -> Any:
        value = super().accept(host, value)
        return value.reshape(-1, value.shape[-1])


class Mlp(Standard):
    """The feed-forward (or mixture-of-experts) sublayer.

    On a mixture of experts the family names the router module (`ROUTER`) and where its output holds
    the logits (`ROUTER_LOGITS`); the experts module (`EXPERTS`) is called as transformers calls it,
    ``experts(hidden, top_k_index, top_k_weights)``.
    """

    #: The router module's name, or ``None`` on a dense MLP.
    ROUTER: str | None = None
    #: Where the router's output holds the logits: `FIRST` (the tensor, or a tuple's first element) or an index.
    ROUTER_LOGITS: Any = FIRST
    #: The experts module's name.
    EXPERTS = "experts"

    def _prepare(self) -> None:
        super()._prepare()
        self._watch_tokens()

    def _watch_tokens(self) -> None:
        """Record the MoE block's batch and sequence sizes as it is called, for the routing values' shape."""
        module = self._module
        if self.ROUTER is not None and not getattr(module, "_nnterp_token_hook", False):
            module.register_forward_pre_hook(_record_token_shape, with_kwargs=True)
            module._nnterp_token_hook = True

    @Value("output", description="What the MLP adds to the residual stream [batch, seq, hidden]")
    def mlp_output(self, value: Any) -> Any:
        """The MLP's contribution to the residual stream."""
        return value

    mlp_input = Value("input", description="The hidden states the MLP reads [batch, seq, hidden]")

    router_logits = PerToken(
        "{self.ROUTER}.output",
        select=lambda mlp: mlp.ROUTER_LOGITS,
        description="The router's logits over the experts [batch, seq, num_experts]",
        unavailable=_router_reason,
    )
    expert_indices = PerToken(
        "{self.EXPERTS}.inputs",
        select=1,
        description="The experts each token is routed to, the top-k choice [batch, seq, k]",
        unavailable=_experts_reason,
    )
    expert_weights = PerToken(
        "{self.EXPERTS}.inputs",
        select=2,
        description="The weights the chosen experts' outputs are mixed with [batch, seq, k]",
        unavailable=_experts_reason,
    )
