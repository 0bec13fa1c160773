"""Harvest: activations over a corpus to disk or an object store, streaming, durable and resumable, on either engine,
fanned out over Ray.

``nnterp_vllm.harvest(model, corpus, values, out, ...)`` calls `harvest.run.harvest`: this
package is callable, so the function and the package share the name the API promises.
Reading a harvest back (`load_harvest`, `Harvest`) imports neither nnsight nor vLLM, so a
trainer's environment can open one; `harvest` itself is imported when first used.
"""

import sys
import types
from typing import Any

from .reader import Harvest, load_harvest
from .store import HarvestError

__all__ = ["Harvest", "HarvestError", "harvest", "load_harvest"]


def __getattr__(name: str) -> Any:
    if name == "harvest":
        from .run import harvest

        return harvest
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from .run import harvest

        return harvest(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
