"""What each standardized value means and how it is read and written; no family's names."""

from .attention import INTERFACE, Attention, GatedAttention, HeadOutputs, needs_eager
from .layer import Layer
from .mixer import Mixer
from .mlp import Mlp
from .sae import SaeFeatures
from .standard import Layers, Standard
from .values import FIRST, WHOLE, Delegate, Derived, Scaled, Value, first_tensor, unavailable, values_of

__all__ = [
    "FIRST",
    "INTERFACE",
    "WHOLE",
    "Attention",
    "Delegate",
    "GatedAttention",
    "Derived",
    "HeadOutputs",
    "Layer",
    "Layers",
    "Mixer",
    "Mlp",
    "SaeFeatures",
    "Scaled",
    "Standard",
    "Value",
    "first_tensor",
    "needs_eager",
    "unavailable",
    "values_of",
]
