"""A stand-in for the ``nnterp`` package, for running nnterp 1.3.0's own tests against nnterp_vllm.

Only names are redirected: ``nnterp.<module>`` is ``nnterp_vllm.<module>`` and ``StandardizedTransformer``
builds nnterp_vllm's model on the engine under test (``NNTERP_COMPAT_ENGINE``: ``transformers`` or
``vllm``). Models are built once per set of arguments (nnterp's tests build the same one in every
test); on vLLM one engine lives at a time, so building another shuts the previous one down.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import nnterp_vllm

MODULES = ("interventions", "prompt_utils", "nnsight_utils", "display", "rename_utils")
for _name in MODULES:
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"nnterp_vllm.{_name}")

ENGINE = os.environ.get("NNTERP_COMPAT_ENGINE", "transformers")
#: What the vLLM engine is built with in these tests (fp32, as on transformers).
VLLM_SETTINGS = {"dtype": "float32"}

built: dict[tuple[str, str], Any] = {}


def shutdown() -> None:
    """Shut down the vLLM engines built here (a transformers model has nothing to shut down)."""
    for model in built.values():
        if ENGINE == "vllm":
            model.shutdown()
    built.clear()


def StandardizedTransformer(model: Any, **kwargs: Any) -> Any:  # noqa: N802 - nnterp's class name
    """nnterp's constructor: nnterp_vllm's model of ``model`` on the engine under test."""
    key = (str(model), repr(sorted(kwargs.items())))
    if key not in built:
        if ENGINE == "vllm":
            shutdown()
            built[key] = nnterp_vllm.StandardizedVLLM(model, **VLLM_SETTINGS, **kwargs)
        else:
            built[key] = nnterp_vllm.StandardizedTransformer(model, **kwargs)
    return built[key]
