"""Fill vLLM's model-info cache for every text architecture both vLLM and transformers know, in this one process.

vLLM inspects a model class it has no cached info for in a fresh interpreter of its own, about 10 s each: on a
machine that never ran the suite, that is 10 s for each of the 70-odd architectures the tests load. Run as a
script, this inspects them all after one import of vLLM, with vLLM's own inspection, hash and cache file, so an
engine finds its entry as if vLLM had written it. An architecture that does not import here is left for vLLM to
inspect itself. `ensure_filled()` runs the script unless `filled_marker()` shows this vLLM and transformers already
filled the cache.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path


def cache_root() -> Path:
    """vLLM's cache root, as `vllm.envs` reads it, without importing vLLM."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm"
    return Path(os.path.expanduser(os.environ.get("VLLM_CACHE_ROOT", default)))


def filled_marker() -> Path:
    """The file saying the cache holds every architecture's info for the installed vLLM (its registry's digest)
    and transformers (its version)."""
    registry = Path(importlib.util.find_spec("vllm").origin).parent / "model_executor" / "models" / "registry.py"
    key = f"{hashlib.sha256(registry.read_bytes()).hexdigest()[:12]}-{importlib.metadata.version('transformers')}"
    return cache_root() / "modelinfos" / f".filled-by-nnterp-vllm-tests-{key}"


def fill() -> None:
    """Inspect and cache every architecture that vLLM registers and transformers names a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from vllm.model_executor.models import registry

    # vLLM's own inspection, hash and cache file; only its fresh interpreter per class becomes this one.
    registry._run_in_subprocess = lambda inspect: inspect()
    causal_lms = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    for architecture, registered in registry.ModelRegistry.models.items():
        if architecture in causal_lms and isinstance(registered, registry._LazyRegisteredModel):
            try:
                registered.inspect_model_cls()
            except Exception:  # noqa: BLE001 - an architecture whose imports fail here is vLLM's to inspect
                continue
    filled_marker().touch()


def ensure_filled() -> None:
    """Fill the cache in a child interpreter unless this vLLM and transformers already did."""
    if not filled_marker().exists():
        filled = subprocess.run([sys.executable, __file__], capture_output=True, text=True)
        if filled.returncode:
            raise RuntimeError(f"filling vLLM's model-info cache failed:\n{filled.stderr}")


if __name__ == "__main__":
    fill()
