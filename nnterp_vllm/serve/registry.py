"""The vector registry: named steering vectors that requests refer to by name, and the steered models (names a
request may ask for as ``model``, each a recipe of specs: `steered_models`).

One `VectorRegistry` per server; with ``--replicas N`` one for all replicas (a Ray Serve deployment of
the same class), so a vector or steered model registered through any replica serves requests on every one. The
server talks to either through `Registry`, which awaits the call where it runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

#: Vectors a registry holds at most unless the server is told otherwise (--max-steering-vectors).
CAPACITY = 1024
#: A registered vector: one ``[hidden_size]`` tensor, or one per layer (a vector made for several layers,
#: applied at its own layers when a spec names no layers).
Vector = torch.Tensor | dict[int, torch.Tensor]


def same(one: Vector, other: Vector) -> bool:
    """Whether two registered vectors are the same."""
    if isinstance(one, dict) or isinstance(other, dict):
        return (
            isinstance(one, dict)
            and isinstance(other, dict)
            and one.keys() == other.keys()
            and all(torch.equal(one[layer], other[layer]) for layer in one)
        )
    return torch.equal(one, other)


class VectorRegistry:
    """At most ``capacity`` named float32 vectors of one model's width (checked by the caller), each one vector or
    one per layer, and at most ``capacity`` steered models (`steered_models.SteeredModel`, checked by the caller)."""

    def __init__(
        self, vectors: dict[str, Vector] | None = None, capacity: int = CAPACITY, models: dict[str, Any] | None = None
    ) -> None:
        self._vectors = dict(vectors or {})
        self._capacity = capacity
        self._models = dict(models or {})

    def add(self, name: str, vector: Vector) -> str:
        """Register ``vector`` as ``name``: ``"created"``, ``"exists"`` (the same vector), ``"conflict"`` (another
        vector) or ``"full"`` (a new name, and the registry holds ``capacity`` vectors)."""
        held = self._vectors.get(name)
        if held is None:
            if len(self._vectors) >= self._capacity:
                return "full"
            self._vectors[name] = vector
            return "created"
        return "exists" if same(held, vector) else "conflict"

    def remove(self, name: str) -> bool:
        """Forget ``name``; whether it was registered. Requests already admitted keep their vector."""
        return self._vectors.pop(name, None) is not None

    def listing(self) -> list[dict[str, Any]]:
        """Each registered vector by name: ``{"name", "size"}``, and ``"layers"`` for one made per layer."""
        listed = []
        for name, vector in sorted(self._vectors.items()):
            one = next(iter(vector.values())) if isinstance(vector, dict) else vector
            listed.append({"name": name, "size": int(one.numel())})
            if isinstance(vector, dict):
                listed[-1]["layers"] = sorted(vector)
        return listed

    def get(self, names: Iterable[str]) -> dict[str, Vector]:
        """The vectors registered under ``names`` (names not registered are left out)."""
        return {name: self._vectors[name] for name in names if name in self._vectors}

    def add_model(self, model: Any) -> str:
        """Register a steered model under its name: ``"created"``, ``"exists"`` (the same recipe), ``"conflict"``
        (another) or ``"full"``."""
        held = self._models.get(model.name)
        if held is None:
            if len(self._models) >= self._capacity:
                return "full"
            self._models[model.name] = model
            return "created"
        return "exists" if held == model else "conflict"

    def remove_model(self, name: str) -> bool:
        """Forget the steered model ``name``; whether it was registered."""
        return self._models.pop(name, None) is not None

    def model_names(self) -> list[str]:
        """The steered models' names, sorted."""
        return sorted(self._models)

    def model_listing(self) -> list[tuple[str, list[Any]]]:
        """Each steered model's name and recipe as the wire format spells it, by name."""
        return [(name, model.steering) for name, model in sorted(self._models.items())]

    def recipe(self, name: str) -> list[dict[str, Any]] | None:
        """The read specs of the steered model ``name`` (``None`` if there is none)."""
        model = self._models.get(name)
        return None if model is None else model.read


class Registry:
    """A `VectorRegistry` held here, or a Ray Serve handle to one; every method is awaited."""

    def __init__(self, registry: VectorRegistry | Any) -> None:
        self._registry = registry
        #: Whether the registry is held here (a call costs a dictionary lookup, not a request to Ray Serve).
        self.local = isinstance(registry, VectorRegistry)

    async def call(self, method: str, *args: Any) -> Any:
        """``registry.method(*args)``, wherever the registry runs."""
        if self.local:
            return getattr(self._registry, method)(*args)
        return await getattr(self._registry, method).remote(*args)
