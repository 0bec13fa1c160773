"""Ministral 3 on vLLM: served by vLLM's Mistral modules."""

from .mistral import ENVOYS, RENAME, Attention, Layer, Mlp

__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp"]
