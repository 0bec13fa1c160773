"""Granite SWA on vLLM: served by vLLM's Granite modules (see the granite family)."""

from .granite import ENVOYS, RENAME, Attention, Layer, Mlp, post_head

__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "post_head"]
