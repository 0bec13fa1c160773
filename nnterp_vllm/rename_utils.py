"""nnterp's renaming helpers: `RenameConfig`, the sizes read from a model's config, and the sublayers it lacks.

Here modules get their standard names from family modules (``nnterp_vllm/families/``); a
`RenameConfig` adds names, as ``rename=`` does.
"""

from __future__ import annotations

from typing import Any

import torch

from .nnterp_options import RenameConfig
from .standardized import Standardized

__all__ = ["RenameConfig", "get_hidden_size", "get_ignores", "get_num_attention_heads", "get_vocab_size"]


def _text_config(model: Any) -> Any:
    """The text model's config of a standardized model, a plain nnsight model, or a transformers model."""
    return model.config.get_text_config()


def _size(model: Any, keys: list[str], key: str | list[str] | int | None, what: str, raise_error: bool) -> int | None:
    """The first of ``keys`` the config sets; a RenameConfig key (or the size itself, an int) comes first."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    config = _text_config(model)
    extra = [key] if isinstance(key, str) else list(key or [])
    for name in [*extra, *keys]:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if raise_error:
        raise ValueError(f"the config of {type(model).__name__} sets none of {extra + keys} ({what})")
    return None


def get_num_attention_heads(
    model: Any, raise_error: bool = True, rename_config: RenameConfig | None = None
) -> int | None:
    """The number of attention heads (a standardized model's ``num_heads``)."""
    if isinstance(model, Standardized):
        return model.num_heads
    key = rename_config.attn_head_config_key if rename_config else None
    return _size(model, ["n_heads", "num_attention_heads", "n_head", "num_heads"], key, "attention heads", raise_error)


def get_hidden_size(model: Any, raise_error: bool = True, rename_config: RenameConfig | None = None) -> int | None:
    """The width of the residual stream (a standardized model's ``hidden_size``)."""
    if isinstance(model, Standardized):
        return model.hidden_size
    key = rename_config.hidden_size_config_key if rename_config else None
    return _size(model, ["hidden_size", "d_model", "n_embd"], key, "hidden size", raise_error)


def get_vocab_size(model: Any, raise_error: bool = True, rename_config: RenameConfig | None = None) -> int | None:
    """The size of the vocabulary (a standardized model's ``vocab_size``)."""
    if isinstance(model, Standardized):
        return model.vocab_size
    key = rename_config.vocab_size_config_key if rename_config else None
    return _size(model, ["vocab_size", "n_vocab"], key, "vocabulary size", raise_error)


def get_ignores(model: torch.nn.Module, rename_config: RenameConfig | None = None) -> list[str]:
    """The sublayers (``"mlp"``, ``"attention"``) the blocks of a transformers model have no module for,
    under the standard names (and those a RenameConfig says to ignore)."""
    from .nnsight_utils import ModuleAccessor

    block = ModuleAccessor(getattr(model, "_model", model), rename_config).nn_model.layers[0]
    ignores = [name for name, module in (("mlp", "mlp"), ("attention", "self_attn")) if not hasattr(block, module)]
    if rename_config is not None:
        ignores += [
            name for name, flag in (("mlp", rename_config.ignore_mlp), ("attention", rename_config.ignore_attn)) if flag
        ]
    return list(dict.fromkeys(ignores))
