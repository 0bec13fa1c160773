"""nnterp_vllm: one standardized interface to transformer internals, on HF transformers and vLLM.

Importing the package loads no transformers modeling code and no vLLM; the engines are
imported when first named.
"""

from __future__ import annotations

from typing import Any

from .errors import UnavailableValue, UnsupportedFamily

__all__ = ["StandardizedTransformer", "StandardizedVLLM", "UnavailableValue", "UnsupportedFamily"]


def __getattr__(name: str) -> Any:
    if name == "StandardizedTransformer":
        from .engines.transformers import StandardizedTransformer

        return StandardizedTransformer
    if name == "StandardizedVLLM":
        from .engines.vllm import StandardizedVLLM

        return StandardizedVLLM
    raise AttributeError(f"module 'nnterp_vllm' has no attribute {name!r}")
