"""The family registry: model_type -> the module that knows that family's names.

A family module is named exactly as its transformers ``model_type`` (dashes become
underscores) and holds ``RENAME``, ``ENVOYS`` and optional size functions. The vLLM
engine's families live in the ``vllm`` subpackage. Modules are imported on first
lookup, so importing the package loads no modeling code.
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings
from types import ModuleType
from typing import Any

from ..errors import UnsupportedFamily
from ._refused import REFUSED

TRANSFORMERS = "transformers"
VLLM = "vllm"
ENGINES = (TRANSFORMERS, VLLM)

#: engine -> model_type -> family module. Filled by `register` and by `lookup` as it imports.
REGISTRY: dict[str, dict[str, ModuleType]] = {engine: {} for engine in ENGINES}

#: model_types whose checkpoints are another type's architecture, served by that type's family.
ALIASES = {"gpt-sw3": "gpt2"}

_PACKAGES = {TRANSFORMERS: __name__, VLLM: f"{__name__}.vllm"}
_NOT_FAMILIES = {"default", "vllm"}


def _engine(engine: str | None) -> str:
    engine = engine or TRANSFORMERS
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")
    return engine


def model_type(config: Any) -> str:
    """The model_type ``config``'s family is looked up by: the text model's, on a multimodal config."""
    text = getattr(config, "text_config", None)
    return getattr(text, "model_type", None) or config.model_type


def module_name(model_type: str) -> str:
    """The module name a model_type's family has."""
    return model_type.replace("-", "_")


def register(family: ModuleType, *model_types: str, engine: str | None = None) -> None:
    """Serve ``model_types`` with ``family`` on ``engine`` (transformers by default)."""
    if not model_types:
        raise ValueError("register() needs at least one model_type to serve with the family")
    for model_type in model_types:
        REGISTRY[_engine(engine)][model_type] = family


def known(engine: str | None = None) -> list[str]:
    """The model_types that have a family module (or a registration) on ``engine``."""
    engine = _engine(engine)
    package = importlib.import_module(_PACKAGES[engine])
    names = {info.name for info in pkgutil.iter_modules(package.__path__) if not info.name.startswith("_")}
    names -= _NOT_FAMILIES
    model_types = {_model_types().get(name, name) for name in names}
    if engine == TRANSFORMERS:
        model_types |= {alias for alias, target in ALIASES.items() if target in model_types}
    return sorted(model_types | set(REGISTRY[engine]))


def _model_types() -> dict[str, str]:
    """Module name -> model_type, for the transformers model_types spelled with dashes (``openai-gpt``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return {module_name(model_type): model_type for model_type in CONFIG_MAPPING_NAMES if "-" in model_type}


def lookup(model_type: str, engine: str | None = None) -> ModuleType:
    """The family serving ``model_type`` on ``engine``.

    On transformers a type without a module warns and gets the `default` family; on vLLM
    there is no default and it raises `UnsupportedFamily`, as it does on both engines for a
    type refused with its reason (``_refused.REFUSED``: encoder-only and encoder-decoder types, and
    architectures without one residual stream through one stack of blocks; on vLLM also
    ``vllm._refused.REFUSED``: types vLLM's CPU build has no architecture or kernel for, or serves otherwise).
    An error raised inside a family module while it imports is re-raised as it is.
    """
    engine = _engine(engine)
    if model_type in REGISTRY[engine]:
        return REGISTRY[engine][model_type]
    if model_type in REFUSED:
        raise UnsupportedFamily(f"model_type {model_type!r} is not served: {REFUSED[model_type]}")
    if engine == VLLM:
        from ._refused_on_vllm import REFUSED as REFUSED_ON_VLLM

        if model_type in REFUSED_ON_VLLM:
            raise UnsupportedFamily(
                f"model_type {model_type!r} is not served on vLLM: {REFUSED_ON_VLLM[model_type]}. "
                "Use StandardizedTransformer for this model"
            )
    if engine == TRANSFORMERS and model_type in ALIASES:
        return lookup(ALIASES[model_type], engine)
    name = f"{_PACKAGES[engine]}.{module_name(model_type)}"
    try:
        family = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
        if engine == VLLM:
            raise UnsupportedFamily(
                f"no vLLM family for model_type {model_type!r}; the vLLM engine serves {known(VLLM)}. "
                "Use StandardizedTransformer for this model, or add a module under nnterp_vllm/families/vllm/."
            ) from None
        warnings.warn(
            f"no family module for model_type {model_type!r}; serving it with the default family, "
            "which reads common module names and serves only what those names show",
            stacklevel=2,
        )
        from . import default

        return default
    REGISTRY[engine][model_type] = family
    return family
