"""Harvest: activations over a corpus to disk, streaming and resumable, on either engine, fanned out over Ray.

``nnterp_vllm.harvest(model, corpus, values, out, ...)`` calls `harvest.run.harvest`: this
package is callable, so the function and the package share the name the API promises.
"""

import sys
import types

from .run import harvest
from .store import Harvest, HarvestError, load_harvest

__all__ = ["Harvest", "HarvestError", "harvest", "load_harvest"]


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return harvest(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
