"""Granite MoE SWA on vLLM: served by vLLM's Granite MoE Shared modules (see the granitemoeshared family)."""

from .granitemoeshared import ENVOYS, RENAME, Attention, Layer, Mlp, post_head

__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "post_head"]
