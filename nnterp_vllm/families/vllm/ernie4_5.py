"""ERNIE 4.5 on vLLM: served by vLLM's llama modules."""

from .llama import ENVOYS, RENAME, Attention, Layer, Mlp

__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp"]
