"""GPT-SW3 on vLLM: GPT-2's architecture, served by the GPT-2 family."""

from .gpt2 import ENVOYS, RENAME, Attention, Layer, Mlp, intermediate_size

__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "intermediate_size"]
