"""The dtype a checkpoint loads in: one rule for both engines.

Unless the caller names one, a checkpoint loads in its own dtype: the one its config names (``dtype``, spelled
``torch_dtype`` by older configs; a multimodal config's text config), else the one its safetensors weights are
stored in, else float32. That is transformers' ``dtype="auto"``, and vLLM's ``"auto"`` without its step that
runs a float32 checkpoint in bfloat16 (or float16), so a float32 checkpoint runs in float32 and a bfloat16 one in
bfloat16 on both engines. ``dtype=`` (or ``torch_dtype=``; ``"auto"`` is this rule) chooses another, on both.

`load_dtype` is the one place the engines take it from: `StandardizedTransformer` hands the result to
transformers, every vLLM engine of the library (`StandardizedVLLM`, `SteeredVLLM`, the server) to vLLM.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

TRANSFORMERS, VLLM = "transformers", "vllm"
#: The dtypes each engine loads a model in (vLLM runs no float64 model).
LOADABLE = {
    TRANSFORMERS: (torch.float32, torch.bfloat16, torch.float16, torch.float64),
    VLLM: (torch.float32, torch.bfloat16, torch.float16),
}
#: Other spellings both engines' users write (torch's and vLLM's).
ALIASES = {"float": torch.float32, "half": torch.float16, "double": torch.float64}
#: The keyword arguments that carry the dtype (transformers 5 spells it ``dtype`` and still takes ``torch_dtype``).
KEYS = ("dtype", "torch_dtype")
#: The dtype of a checkpoint that says none, neither in its config nor in its weights.
FALLBACK = torch.float32
#: safetensors' names of the floating dtypes a checkpoint's weights are stored in.
SAFETENSORS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def name(dtype: torch.dtype) -> str:
    """``dtype``'s name as both engines take it (``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def _choices(engine: str) -> str:
    return ", ".join(repr(name(dtype)) for dtype in LOADABLE[engine])


def requested(value: Any, engine: str, what: str = "dtype") -> torch.dtype | None:
    """The dtype ``value`` asks ``engine`` to load a model in (``None`` for ``None`` or ``"auto"``: the checkpoint's).

    Takes a torch dtype, or its name (``"bfloat16"``, ``"torch.bfloat16"``, ``"half"``, ``"float"``); ValueError
    naming ``what``, what was wrong and what would be right otherwise."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    dtype = value
    if isinstance(value, str):
        spelled = value.strip().lower().removeprefix("torch.")
        dtype = ALIASES.get(spelled, getattr(torch, spelled, None))
    if isinstance(dtype, torch.dtype) and dtype in LOADABLE[engine]:
        return dtype
    if isinstance(dtype, torch.dtype) and dtype in LOADABLE[TRANSFORMERS]:
        why = f"vLLM runs no {name(dtype)} model"
    elif isinstance(dtype, torch.dtype):
        why = f"{name(dtype)} is no dtype a model's weights compute in"
    else:
        why = "that is not a torch dtype"
    quantized = " (vLLM quantizes with quantization=)" if engine == VLLM and isinstance(value, str) else ""
    raise ValueError(
        f"{what} must name a torch dtype the {engine} engine loads a model in: 'auto' (the checkpoint's own) or "
        f"one of {_choices(engine)}; got {value!r}: {why}{quantized}"
    )


def checkpoint_dtype(config: Any, checkpoint: Any = None) -> torch.dtype:
    """The dtype a checkpoint with ``config`` loads in unless told: its config's, else its safetensors weights'
    (a local ``checkpoint`` directory), else float32 (`FALLBACK`)."""
    for where in (config, config.get_text_config()):
        dtype = getattr(where, "dtype", None) or getattr(where, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = ALIASES.get(dtype.removeprefix("torch."), getattr(torch, dtype.removeprefix("torch."), None))
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            return dtype
    return weights_dtype(checkpoint) or FALLBACK


def weights_dtype(checkpoint: Any) -> torch.dtype | None:
    """The floating dtype the weights of a local ``checkpoint`` directory are stored in (its first safetensors file's
    first floating tensor), or ``None`` where it has none to read."""
    if not isinstance(checkpoint, str | os.PathLike) or not os.path.isdir(checkpoint):
        return None
    files = sorted(entry for entry in os.listdir(checkpoint) if entry.endswith(".safetensors"))
    for file in files:
        try:
            with open(os.path.join(checkpoint, file), "rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(size))
        except (OSError, ValueError):
            continue
        for key, entry in header.items():
            if key != "__metadata__" and entry.get("dtype") in SAFETENSORS:
                return SAFETENSORS[entry["dtype"]]
    return None


def given(kwargs: dict[str, Any]) -> tuple[str, Any]:
    """The dtype argument in ``kwargs`` and its spelling, taken out of them (``("dtype", None)`` where none is).

    ValueError where ``dtype=`` and ``torch_dtype=`` both name one and they differ."""
    present = {key: kwargs.pop(key) for key in KEYS if kwargs.get(key) is not None}
    for key in KEYS:
        kwargs.pop(key, None)
    if len(present) == 2 and str(present["dtype"]).removeprefix("torch.") != str(present["torch_dtype"]).removeprefix(
        "torch."
    ):
        raise ValueError(
            f"dtype={present['dtype']!r} and torch_dtype={present['torch_dtype']!r} are two spellings of one "
            "argument and name different dtypes; give one (dtype=)"
        )
    return next(iter(present.items()), ("dtype", None))


def load_dtype(checkpoint: Any, config: Any, kwargs: dict[str, Any], engine: str) -> str:
    """The dtype ``engine`` loads ``checkpoint`` (whose config is ``config``) in, by name: the caller's ``dtype=`` /
    ``torch_dtype=`` (taken out of ``kwargs``; ``"auto"`` or none is the checkpoint's own, `checkpoint_dtype`)."""
    spelling, value = given(kwargs)
    dtype = requested(value, engine, spelling)
    if dtype is None:
        dtype = checkpoint_dtype(config, checkpoint)
        if dtype not in LOADABLE[engine]:
            raise ValueError(
                f"{checkpoint} is a {name(dtype)} checkpoint, which the {engine} engine does not run; pass dtype= "
                f"one of {_choices(engine)}"
            )
    return name(dtype)


__all__ = ["FALLBACK", "LOADABLE", "checkpoint_dtype", "load_dtype", "requested"]
