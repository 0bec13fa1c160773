"""What the specs change in the residual stream, as tensor code: the eager `Standardized.steer`, `cap`, `ablate`
and `clamp` and the engine's steering table compute the same change."""

from __future__ import annotations

from typing import Any

import torch


def feature_change(
    stream: torch.Tensor,
    read: torch.Tensor,
    write: torch.Tensor,
    low: Any = None,
    high: Any = None,
    *,
    offset: Any = 0.0,
    threshold: Any = None,
    scale: Any = 1.0,
    pre: torch.Tensor | None = None,
    floor: Any = None,
) -> torch.Tensor:
    """What to add to ``stream`` (``[..., hidden]``) to move its activation along ``read`` to its target, along
    ``write``: the activation ``a`` is ``pre = stream . read + offset`` (or ``pre`` as given), zero unless ``pre >
    threshold`` and ``pre >= floor``; the target is ``clamp(scale * a, low, high)``; the change ``(target - a) *
    write``. A cap is ``read = write = u`` with no threshold; an SAE feature's clamp reads its encoder's column and
    writes its decoder row. Every argument after ``write`` is a number, ``None`` (no bound) or a tensor of the
    stream's leading shape. In the stream's dtype, computed in float32; pure tensor code."""
    if pre is None:
        pre = (stream.float() * read.float()).sum(-1) + offset
    active = pre
    if threshold is not None:
        active = torch.where(pre > threshold, pre, torch.zeros_like(pre))
    if floor is not None:
        active = torch.where(pre >= floor, active, torch.zeros_like(active))
    target = active * scale
    if low is not None or high is not None:
        target = target.clamp(low, high)
    return ((target - active).unsqueeze(-1) * write.float()).to(stream.dtype)


def projection_change(stream: torch.Tensor, direction: torch.Tensor, low: Any, high: Any) -> torch.Tensor:
    """What to add to ``stream`` (``[..., hidden]``) so that its projection on the unit ``direction`` lies in
    ``[low, high]`` (`feature_change` reading and writing along the direction)."""
    return feature_change(stream, direction, direction, low, high)


def relative_direction(vector: torch.Tensor) -> torch.Tensor:
    """The unit direction a relative `Steering` adds along (``[hidden]`` or ``[n, hidden]``, a unit row each):
    ``vector / |vector|`` computed in float64, as float32. The engine form holds it, and ``steer`` adds the same."""
    vector = vector.detach().double()
    return (vector / vector.norm(dim=-1, keepdim=True)).float()


def relative_addition(unit: torch.Tensor, factor: Any, unsteered: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a relative `Steering` adds to a stream whose value before any edit at its block is ``unsteered``
    (``[..., hidden]``): ``factor * |unsteered| * unit``, the norm over the hidden dimension, all in float32 (the
    factor times the unit direction first, as the engine's pool entry holds it), in ``dtype``."""
    norm = torch.linalg.vector_norm(unsteered, dim=-1, keepdim=True, dtype=torch.float32)
    return ((factor * unit.to(device=unsteered.device, dtype=torch.float32)) * norm).to(dtype)


__all__ = ["feature_change", "projection_change", "relative_addition", "relative_direction"]
