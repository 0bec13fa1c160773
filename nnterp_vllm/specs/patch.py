"""Activation patching as a spec: `Patch` sets a value of some blocks to given rows at prompt positions, checked
as the steering specs (`specs.steering`) are and carried to the engine beside them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import arguments
from .steering import Placed

#: The standardized values a `Patch` sets: the stream a block hands on, and what its attention and its MLP add to it.
PATCHED_VALUES = ("layer_output", "attention_output", "mlp_output")


@dataclass(frozen=True, eq=False)
class Patch(Placed):
    """Set ``value`` of the blocks ``layers`` to ``vectors`` at the prompt ``positions``: ``h' = v`` there, untouched
    elsewhere (activation patching: rows a clean run kept, set into a corrupted run).

    Args:
        vectors: One ``[hidden_size]`` vector for every position, or ``[len(positions), hidden_size]``: a row per
            position, in the order given (a tensor, or lists of floats).
        layers: A standardized block index or a list of them (the same rows are set at each).
        positions: A non-empty list of prompt positions (negative counting from the prompt's end), each once.
        value: ``"layer_output"`` (default: the stream leaving the block), ``"attention_output"`` or ``"mlp_output"``
            (what the block's attention or MLP adds to the stream).

    The checks that need no model run here; the vectors' width, the layer range and the positions against the
    prompt are checked when a request carrying the spec is made.
    """

    vectors: Any = field(repr=False)
    layers: int | Sequence[int] = field(default=None)  # type: ignore[assignment]
    positions: Sequence[int] = field(default=None)  # type: ignore[assignment]
    value: str = "layer_output"
    what = "Patch"

    def __post_init__(self) -> None:
        what = self.what
        if self.layers is None or self.positions is None:
            raise ValueError(
                f"{what}: name the blocks and the prompt positions, e.g. {what}(rows, layers=8, positions=[3])"
            )
        object.__setattr__(self, "layers", arguments.layer_list(self.layers, what))
        positions = arguments.listed_ints(self.positions)
        if positions is None:
            raise ValueError(
                f"{what}: positions must be a non-empty list of prompt positions (ints, negative counting from the "
                f"prompt's end), got {self.positions!r}"
            )
        if len(set(positions)) != len(positions):
            raise ValueError(f"{what}: each position is set once; {positions} names one twice")
        object.__setattr__(self, "positions", positions)
        if self.value not in PATCHED_VALUES:
            raise ValueError(f"{what}: value must be one of {', '.join(PATCHED_VALUES)}, got {self.value!r}")
        vectors = self.vectors
        if isinstance(vectors, (list, tuple)) and vectors and isinstance(vectors[0], (list, tuple)):
            vectors = torch.stack([arguments.one_vector(row, what) for row in vectors])
        elif not isinstance(vectors, torch.Tensor) or vectors.dim() == 1:
            vectors = arguments.one_vector(vectors, what)
        else:
            arguments.hidden_vector(vectors, vectors.shape[-1], what)
        if vectors.dim() == 2 and vectors.shape[0] != len(positions):
            raise ValueError(
                f"{what}: vectors has {vectors.shape[0]} rows for {len(positions)} positions: give one row per "
                "position, or one [hidden_size] vector for all of them"
            )
        object.__setattr__(self, "vectors", vectors.detach())

    def rows(self) -> torch.Tensor:
        """``[len(positions), hidden]``: the vector each position is set to, in the order of ``positions``."""
        return self.vectors.expand(len(self.positions), -1) if self.vectors.dim() == 1 else self.vectors

    def resolved(self, num_layers: int, hidden_size: int, prompt_length: int) -> list[dict[str, Any]]:
        """This spec in its engine form for a prompt of ``prompt_length`` tokens: one entry per position (each its
        own row of the engine's steering pool), as `Steering.resolved` makes them, the value named. Raises
        `ValueError` as `steer` does."""
        what = self.what
        layers = arguments.layer_indices(self.layers, num_layers, what)
        rows = arguments.hidden_vector(self.rows(), hidden_size, what)
        positions = arguments.positions_within(self.positions, prompt_length, what)
        if len(set(positions)) != len(positions):
            raise ValueError(
                f"{what}: positions {self.positions} name one position of the {prompt_length}-token prompt twice"
            )
        return [
            {
                "kind": "patch",
                "layers": layers,
                "value": self.value,
                "vector": row.to(device="cpu", dtype=torch.float32).tolist(),
                "positions": [position],
            }
            for position, row in zip(positions, rows)
        ]

    def scaled(self, factor: float) -> Patch:
        """This patch: it sets its rows whatever the factor."""
        return self


__all__ = ["PATCHED_VALUES", "Patch"]
