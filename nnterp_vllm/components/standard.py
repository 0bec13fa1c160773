"""`Standard`, the envoy every component derives from; `Layers`, the block container."""

from __future__ import annotations

from typing import Any

from nnsight.intervention.envoy import Envoy

from .values import Value, values_of


class Standard(Envoy):
    """An envoy that carries standardized values (a block, its attention, its MLP)."""

    #: Instrument this module's forward when the envoy is built, for a family whose value is an
    #: operation in a forward that is already running when the value is read.
    SOURCED = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prepare()

    def _update(self, module: Any) -> None:
        super()._update(module)
        self._prepare()

    def _prepare(self) -> None:
        """Ready the module for this envoy's values: when the envoy is built and when its module is replaced."""
        if self.SOURCED:
            self.source  # noqa: B018 - reading it instruments the forward

    @classmethod
    def values(cls) -> dict[str, Value]:
        """This class's standardized values by name."""
        return values_of(cls)

    def support(self) -> dict[str, str | None]:
        """Each value here -> ``None`` when available, else the reason it is not."""
        return {name: value.reason(self) for name, value in self.values().items()}


class Layers(Envoy):
    """The block container (``model.layers``): indexing past the end names the number of layers."""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, bool) or not isinstance(key, (int, slice)):
            raise TypeError(f"layers are indexed by an int or a slice, got {type(key).__name__} {key!r}")
        if isinstance(key, int):
            count = len(self._module)
            if not -count <= key < count:
                raise IndexError(
                    f"layer {key} is out of range: the model has num_layers={count} "
                    f"(valid indices 0..{count - 1}, or -{count}..-1)"
                )
        return super().__getitem__(key)
