"""`Mlp`: the feed-forward sublayer."""

from __future__ import annotations

from typing import Any

from .standard import Standard
from .values import Value


class Mlp(Standard):
    """The feed-forward (or mixture-of-experts) sublayer."""

    @Value("output", description="What the MLP adds to the residual stream [batch, seq, hidden]")
    def mlp_output(self, value: Any) -> Any:
        """The MLP's contribution to the residual stream."""
        return value
