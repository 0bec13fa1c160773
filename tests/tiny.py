"""Tiny random checkpoints built offline from transformers config classes, cached on disk.

Every checkpoint has head_dim 32 (vLLM's CPU attention needs >= 32), a byte-level
tokenizer, and weights drawn from a fixed seed, so HF and vLLM load identical files.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("NNTERP_VLLM_TEST_CACHE", ROOT / ".cache" / "tiny"))

SIZES: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

#: Per model_type: config keys that differ from SIZES (a config spelling a size its own way,
#: or a default that does not fit a tiny model). Modules in ``tests/tiny_configs/`` add theirs.
OVERRIDES: dict[str, dict[str, Any]] = {
    "gpt2": {"n_inner": 256, "n_positions": 256},
    "gptj": {"n_inner": 256, "n_positions": 256, "rotary_dim": 16},
    "opt": {"ffn_dim": 256, "word_embed_proj_dim": 128},
    "bloom": {},
    "gemma": {"tie_word_embeddings": True},
    "gemma2": {"sliding_window": 16, "query_pre_attn_scalar": 32, "tie_word_embeddings": True},
    "gemma3_text": {"sliding_window": 16, "query_pre_attn_scalar": 32, "tie_word_embeddings": True},
}

#: The model_types each module of ``tests/tiny_configs/`` sets keys for, by module name.
GROUPS: dict[str, list[str]] = {}
for _module in sorted((Path(__file__).parent / "tiny_configs").glob("[!_]*.py")):
    _spec = importlib.util.spec_from_file_location(f"tiny_configs.{_module.stem}", _module)
    _loaded = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_loaded)
    OVERRIDES.update(_loaded.OVERRIDES)
    GROUPS[_module.stem] = sorted(_loaded.OVERRIDES)

#: Per model_type: keys its tiny checkpoint takes in the vLLM tests, where vLLM's model code or a kernel of its CPU
#: build takes less than transformers' config allows (the tests of that type run both engines on this checkpoint).
VLLM_OVERRIDES: dict[str, dict[str, Any]] = {
    # vLLM's Command-R and BLOOM unembed with their embedding whatever tie_word_embeddings says.
    "cohere": {"tie_word_embeddings": True},
    "bloom": {"tie_word_embeddings": True},
    # vLLM's Falcon MLP is 4 * hidden_size wide whatever ffn_hidden_size says.
    "falcon": {"ffn_hidden_size": 512},
    # vLLM's StableLM runs the sequential block only, without per-head query/key norms.
    "stablelm": {"qk_layernorm": False, "use_parallel_residual": False},
}

#: A checkpoint larger than this did not take the tiny sizes (its config spells them otherwise).
MAX_PARAMETERS = 20_000_000

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}


def tokenizer() -> Any:
    """A byte-level tokenizer (no merges): every text encodes, ids < 259."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS.values())}
    vocab.update({char: len(vocab) + i for i, char in enumerate(sorted(alphabet))})
    model = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=model, **SPECIAL_TOKENS)


def _has(config: Any, key: str) -> bool:
    """Whether a config has ``key`` as one global value (some raise for a value that varies per layer)."""
    try:
        return hasattr(config, key)
    except Exception:  # noqa: BLE001 - transformers' per-layer attribute error is no AttributeError
        return False


def config_kwargs(model_type: str, **extra: Any) -> dict[str, Any]:
    """The config keys a tiny ``model_type`` checkpoint is built with: the SIZES its config class knows."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()
    # A size the class computes (a read-only property, like Falcon's head_dim) cannot be passed in.
    known = {
        key: value
        for key, value in SIZES.items()
        if _has(defaults, key) and not isinstance(getattr(config_class, key, None), property)
    }
    kwargs = {**known, **OVERRIDES.get(model_type, {}), **extra}
    # A multimodal wrapper's text model takes the keys its own model_type's tiny checkpoint is built with.
    text_type = getattr(getattr(defaults, "text_config", None), "model_type", None)
    if text_type in CONFIG_MAPPING and text_type != model_type:
        kwargs["text_config"] = {**config_kwargs(text_type), **kwargs.get("text_config", {})}
    return kwargs


def checkpoint(model_type: str, seed: int = 0, **extra: Any) -> Path:
    """The directory of a tiny random ``model_type`` checkpoint, built once and cached."""
    import transformers

    kwargs = config_kwargs(model_type, **extra)
    digest = hashlib.sha256(json.dumps([kwargs, seed, transformers.__version__], sort_keys=True).encode()).hexdigest()
    path = CACHE / f"{model_type}-{digest[:12]}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **kwargs)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if parameters > MAX_PARAMETERS:
        raise ValueError(
            f"{model_type}'s config does not take the tiny sizes ({parameters / 1e6:.0f}M parameters); "
            "add its own spellings to tests/tiny_configs/"
        )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    staging = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(staging)
    tokenizer().save_pretrained(staging)
    staging.rename(path)
    return path


def vllm_checkpoint(model_type: str) -> Path:
    """The tiny ``model_type`` checkpoint both engines load in the vLLM tests (`VLLM_OVERRIDES` applied)."""
    return checkpoint(model_type, **VLLM_OVERRIDES.get(model_type, {}))
