"""The vector registry: named steering vectors that requests refer to by name.

One `VectorRegistry` per server; with ``--replicas N`` one for all replicas (a Ray Serve deployment of
the same class), so a vector registered through any replica steers requests on every one. The server
talks to either through `Registry`, which awaits the call where it runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class VectorRegistry:
    """Named float32 vectors of one model's width (checked by the caller); names map to one vector each."""

    def __init__(self, vectors: dict[str, torch.Tensor] | None = None) -> None:
        self._vectors = dict(vectors or {})

    def add(self, name: str, vector: torch.Tensor) -> str:
        """Register ``vector`` as ``name``: ``"created"``, ``"exists"`` (the same vector) or ``"conflict"``."""
        held = self._vectors.get(name)
        if held is None:
            self._vectors[name] = vector
            return "created"
        return "exists" if torch.equal(held, vector) else "conflict"

    def remove(self, name: str) -> bool:
        """Forget ``name``; whether it was registered. Requests already admitted keep their vector."""
        return self._vectors.pop(name, None) is not None

    def sizes(self) -> dict[str, int]:
        """Each registered name and its vector's length, by name."""
        return {name: int(vector.numel()) for name, vector in sorted(self._vectors.items())}

    def get(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The vectors registered under ``names`` (names not registered are left out)."""
        return {name: self._vectors[name] for name in names if name in self._vectors}


class Registry:
    """A `VectorRegistry` held here, or a Ray Serve handle to one; every method is awaited."""

    def __init__(self, registry: VectorRegistry | Any) -> None:
        self._registry = registry
        self._local = isinstance(registry, VectorRegistry)

    async def call(self, method: str, *args: Any) -> Any:
        """``registry.method(*args)``, wherever the registry runs."""
        if self._local:
            return getattr(self._registry, method)(*args)
        return await getattr(self._registry, method).remote(*args)
