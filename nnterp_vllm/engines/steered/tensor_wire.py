"""Tensors a worker hands back to the client (kept rows, probe scores): an RPC result crosses processes as plain
data, so a tensor leaving a worker's process travels as its dtype's name, shape and bytes (`pack`), and is a tensor
again on the client (`unpack`)."""

from __future__ import annotations

from typing import Any

import torch


def pack(tensor: torch.Tensor) -> tuple[str, list[int], bytes]:
    """A tensor as plain data an RPC result carries across processes: dtype name, shape, raw bytes."""
    return (
        str(tensor.dtype).removeprefix("torch."),
        list(tensor.shape),
        tensor.contiguous().view(torch.uint8).numpy().tobytes(),
    )


def unpack(packed: Any) -> torch.Tensor:
    """The tensor `pack` made plain data (a tensor itself where it never left its process)."""
    if isinstance(packed, torch.Tensor):
        return packed
    dtype, shape, data = packed
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


__all__ = ["pack", "unpack"]
