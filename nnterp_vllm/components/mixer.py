"""`Mixer`: a token mixer other than softmax attention (a state-space scan, a short convolution, linear attention)."""

from __future__ import annotations

from typing import Any

from nnsight.intervention.envoy import Envoy

from .standard import Standard
from .values import Located, Value


class Mixer(Standard):
    """A recurrent or convolutional token mixer in a block's attention slot (mamba-style scans, LFM2's convolution).

    A family names the module ``mixer``; its output is what the block adds to the residual stream.
    """

    mixer_output = Value("output", description="What the token mixer adds to the residual stream [batch, seq, hidden]")


class MixerOutput(Value):
    """A block's token-mixing contribution: its `Mixer`'s output where it has one, else its ``attention_output``."""

    def __init__(self, *, description: str = "") -> None:
        super().__init__(description=description)

    @staticmethod
    def target(block: Envoy) -> tuple[Envoy, str]:
        """The envoy and value name this block's mixer output is read as."""
        mixer = block.__dict__.get("mixer")
        if isinstance(mixer, Mixer):
            return mixer, "mixer_output"
        return block, "attention_output"

    def reason(self, block: Envoy) -> str | None:
        host, name = self.target(block)
        if host is block and not isinstance(block.__dict__.get("self_attn"), Envoy):
            return "this block has no token mixer: neither a mixer nor a self_attn module"
        return type(host).values()[name].reason(host)

    def read(self, block: Envoy) -> Any:
        self.check(block)
        host, name = self.target(block)
        return getattr(host, name)

    def located(self, block: Envoy) -> Located | str:
        host, name = self.target(block)
        return self.reason(block) or type(host).values()[name].located(host)

    def __set__(self, block: Envoy, value: Any) -> None:
        self.check(block)
        host, name = self.target(block)
        setattr(host, name, value)
