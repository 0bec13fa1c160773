"""How a standardized trace travels to where the model is: the model's remote key, and the dry run of sending one.

A trace sent elsewhere (NDIF's ``remote=True``, or its dry run ``remote="local"``) travels in nnsight's own
request format: the block's source, the values it references, and the model object by value with its modules
and interleaver as references the far side resolves against the model it holds. The model's class and the
standardized values on it are imported there by name, so the far side has this library installed.

The key names the class and the checkpoint: ``nnterp_vllm.engines.transformers.StandardizedTransformer:``
followed by nnsight's JSON (``repo_id``, ``revision``, ``task``) for transformers, and
``nnterp_vllm.engines.vllm.StandardizedVLLM:<checkpoint>`` for vLLM. A hub id is keyed as nnsight keys it (the
hub's own spelling of the id, looked up once); a local checkpoint directory by its absolute path, which a
server on the same file system loads as it is.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import packages_distributions
from typing import Any

from nnsight.intervention.backends.local import LocalSimulationBackend

#: The route of a trace server (nnsight-serve's, and ``nnterp-vllm serve --traces``') that a trace is posted to.
TRACE_PATH = "/v1/nnsight/generate"


def checkpoint_key(checkpoint: str) -> str:
    """``checkpoint`` as a model key names it: a local directory by its absolute path, a hub id as it is."""
    expanded = os.path.expanduser(checkpoint)
    return os.path.abspath(expanded) if os.path.isdir(expanded) else checkpoint


class InstalledServerSimulation(LocalSimulationBackend):
    """``remote="local"``: nnsight's dry run of the remote path (serialize, rebuild with the caller's own modules
    hidden, run here), against a server that has this library installed.

    Modules of installed distributions stay importable while the trace is rebuilt, as they are on such a server,
    which imported them once. nnsight's own dry run hides every module outside NDIF's few packages, so rebuilding
    a standardized trace imported this library, vLLM and typing_extensions a second time beside the live ones:
    a second vLLM refuses to import, and a second typing_extensions breaks ``typing`` for the whole process.
    The caller's own modules (scripts, notebooks' helpers) are hidden as before: what a trace uses from them
    must travel with it (nnsight registers them to be sent by value).
    """

    def _hide_local_modules(self) -> dict[str, Any]:
        hidden = super()._hide_local_modules()
        installed = set(packages_distributions())
        for name in [name for name in hidden["modules"] if name.partition(".")[0] in installed]:
            sys.modules[name] = hidden["modules"].pop(name)
        return hidden
