"""nnterp_vllm: one standardized interface to transformer internals, on HF transformers and vLLM.

Importing the package loads no transformers modeling code and no vLLM; the engines are
imported when first named.
"""

from __future__ import annotations

from typing import Any

from .errors import UnavailableValue, UnsupportedFamily

# anyio defines its typed-attribute sets (every TypedAttributeSet subclass) lazily, at the first async
# stream or task group (an httpx/openai async client, a server), and refuses to define one once nnsight
# has mounted `.save` on every object: so they are defined here, before any engine imports nnsight.
try:
    from anyio.abc import SocketAttribute  # noqa: F401
    from anyio.streams.file import FileStreamAttribute  # noqa: F401
    from anyio.streams.tls import TLSAttribute  # noqa: F401
except ImportError:  # no anyio, nothing to break
    pass

__all__ = [
    "AsyncSteeredVLLM",
    "StandardizedTransformer",
    "StandardizedVLLM",
    "SteeredVLLM",
    "Steering",
    "UnavailableValue",
    "UnsupportedFamily",
    "harvest",
    "load_harvest",
]


def __getattr__(name: str) -> Any:
    if name == "StandardizedTransformer":
        from .engines.transformers import StandardizedTransformer

        return StandardizedTransformer
    if name == "StandardizedVLLM":
        from .engines.vllm import StandardizedVLLM

        return StandardizedVLLM
    if name == "Steering":
        from .steering import Steering

        return Steering
    if name in ("SteeredVLLM", "AsyncSteeredVLLM"):
        from .engines import steered

        return getattr(steered, name)
    if name in ("harvest", "load_harvest"):
        import importlib

        package = importlib.import_module(".harvest", __name__)  # callable: nnterp_vllm.harvest(...)
        return package if name == "harvest" else package.load_harvest
    raise AttributeError(f"module 'nnterp_vllm' has no attribute {name!r}")
