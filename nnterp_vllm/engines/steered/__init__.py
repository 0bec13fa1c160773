"""The steered engine: vLLM with the in-engine operations (steering, capture, probes, metrics) compiled into its
graph, its worker and scheduler, and the memory model that sizes its buffers.

It imports the engines' room (the platform, shutdown, the compile cache); nothing there imports it. Importing this
package loads no vLLM: `SteeredVLLM` and `AsyncSteeredVLLM` are imported when first named.
"""

from typing import Any

__all__ = ["AsyncSteeredVLLM", "SteeredVLLM"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
