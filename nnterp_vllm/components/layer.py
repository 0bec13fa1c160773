"""`Layer`: a decoder block and the residual stream through it."""

from __future__ import annotations

from .mixer import MixerOutput
from .sae import SaeFeatures
from .standard import Standard
from .values import Delegate, Value


class Layer(Standard):
    """A decoder block.

    ``layer_output == layer_input + attention_output + mlp_output`` on every family,
    sequential or parallel. A family whose contribution lives elsewhere (a post-norm, a
    call inside the block) points ``attention_output`` / ``mlp_output`` there. A block whose
    token mixer is not attention (a state-space scan, a convolution) has a ``mixer`` module
    instead, and ``layer_output == layer_input + mixer_output + mlp_output``. ``sae_features`` are the
    features of the SAE the model holds at the block (``saes=[...]``), encoded from ``layer_output``.
    """

    layer_input = Value("input", description="The residual stream entering the block [batch, seq, hidden]")
    layer_output = Value("output", description="The residual stream leaving the block [batch, seq, hidden]")

    attention_output = Delegate(
        "self_attn", "attention_output", description="What the attention sublayer adds to the residual stream"
    )
    mlp_output = Delegate("mlp", "mlp_output", description="What the MLP sublayer adds to the residual stream")
    mixer_output = MixerOutput(
        description="What the token-mixing sublayer adds: the block's recurrent mixer's output, else attention_output"
    )
    sae_features = SaeFeatures(
        description="The features of the SAE reading the block's output, encoded from layer_output [batch, seq, d_sae]"
    )
