"""`Layer`: a decoder block and the residual stream through it."""

from __future__ import annotations

from typing import Any

from .mixer import MixerOutput
from .standard import Standard
from .values import Delegate, Value


class Layer(Standard):
    """A decoder block.

    ``layer_output == layer_input + attention_output + mlp_output`` on every family,
    sequential or parallel. A family whose contribution lives elsewhere (a post-norm, a
    call inside the block) points ``attention_output`` / ``mlp_output`` there. A block whose
    token mixer is not attention (a state-space scan, a convolution) has a ``mixer`` module
    instead, and ``layer_output == layer_input + mixer_output + mlp_output``.
    """

    @Value("input", description="The residual stream entering the block [batch, seq, hidden]")
    def layer_input(self, value: Any) -> Any:
        """The residual stream entering this block."""
        return value

    @Value("output", description="The residual stream leaving the block [batch, seq, hidden]")
    def layer_output(self, value: Any) -> Any:
        """The residual stream leaving this block, a tensor even when the block returns a tuple."""
        return value

    attention_output = Delegate(
        "self_attn", "attention_output", description="What the attention sublayer adds to the residual stream"
    )
    mlp_output = Delegate("mlp", "mlp_output", description="What the MLP sublayer adds to the residual stream")
    mixer_output = MixerOutput(
        description="What the token-mixing sublayer adds: the block's recurrent mixer's output, else attention_output"
    )
