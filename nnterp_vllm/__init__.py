"""nnterp_vllm: one standardized interface to transformer internals, on HF transformers and vLLM.

Importing the package loads no transformers modeling code and no vLLM; the engines are
imported when first named.
"""

from __future__ import annotations

from typing import Any

from .errors import EngineShutDown, UnavailableValue, UnsupportedFamily

# anyio checks that every attribute of each of its typed-attribute sets is annotated, and defines most
# sets lazily (at the first async stream or task group: an httpx or openai async client, a server);
# once nnsight has mounted `.save` on every object, every set fails that check. Declaring `save` on
# their base keeps async HTTP working in any process that imports nnterp_vllm, before or after nnsight.
try:
    from anyio import TypedAttributeSet
except ImportError:  # no anyio, nothing to break
    pass
else:
    TypedAttributeSet.__annotations__.setdefault("save", Any)

__all__ = [
    "Ablate",
    "AsyncSteeredVLLM",
    "Cap",
    "Capture",
    "Clamp",
    "EngineShutDown",
    "LogitDiff",
    "Logprob",
    "Patch",
    "Probe",
    "Recovered",
    "SAE",
    "StandardizedTransformer",
    "StandardizedVLLM",
    "SteeredVLLM",
    "Steering",
    "UnavailableValue",
    "UnsupportedFamily",
    "contrast_steering",
    "harvest",
    "load_harvest",
    "load_steering",
    "patch_sweep",
    "sweep",
]


def __getattr__(name: str) -> Any:
    if name == "StandardizedTransformer":
        from .engines.transformers import StandardizedTransformer

        return StandardizedTransformer
    if name == "StandardizedVLLM":
        from .engines.vllm import StandardizedVLLM

        return StandardizedVLLM
    if name in ("Steering", "Cap", "Ablate", "Clamp"):
        from .specs import steering as specs

        return getattr(specs, name)
    if name == "Patch":
        from .specs.patch import Patch

        return Patch
    if name == "SAE":
        from .specs.saes import SAE

        return SAE
    if name in ("load_steering", "contrast_steering"):
        from .steering import sources

        return getattr(sources, name)
    if name == "sweep":
        from .steering.sweeps import sweep

        return sweep
    if name == "Probe":
        from .specs.probes import Probe

        return Probe
    if name in ("LogitDiff", "Logprob", "Recovered"):
        from .specs import metrics

        return getattr(metrics, name)
    if name == "patch_sweep":
        from .steering.patching import patch_sweep

        return patch_sweep
    if name == "Capture":
        from .specs.capture import Capture

        return Capture
    if name in ("SteeredVLLM", "AsyncSteeredVLLM"):
        from .engines.steered import engine as steered

        return getattr(steered, name)
    if name in ("harvest", "load_harvest"):
        import importlib

        package = importlib.import_module(".harvest", __name__)  # callable: nnterp_vllm.harvest(...)
        return package if name == "harvest" else package.load_harvest
    raise AttributeError(f"module 'nnterp_vllm' has no attribute {name!r}")
