"""The model both halves of ``gpu.py`` load, built when no ``--model`` is given, and every workload's size."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The value both capture and harvest keep: every block's residual stream.
EVERY_BLOCK = "layers.*.layer_output"


@dataclass(frozen=True)
class Scale:
    """The model built when no ``--model`` is given, and every workload's size."""

    model: dict[str, int]
    trace_batch: int  # rows x tokens of the traced batch
    trace_tokens: int
    calls: int  # timed calls of each trace configuration per round
    harvest_rows: int  # rows of harvest_tokens tokens (BOS included), harvested harvest_batch at a time
    harvest_tokens: int
    harvest_batch: int
    prompts: int  # steered prompts (each its own vector) of prompt_tokens tokens, new_tokens generated
    prompt_tokens: int
    new_tokens: int
    prefill_prompts: int  # prompts of prefill_tokens tokens per capture round
    prefill_tokens: int
    checked_prompts: int  # captured prompts whose rows are compared with the eager engine's


#: The random Llama's config: (full size, --small).
LLAMA = {
    "hidden_size": (2048, 256),
    "intermediate_size": (8192, 512),
    "num_hidden_layers": (16, 4),
    "num_attention_heads": (16, 4),
    "num_key_value_heads": (8, 2),
    "head_dim": (128, 64),
    "vocab_size": (32000, 1024),
    "max_position_embeddings": (2048, 512),
}
#: Every workload's size (`Scale`'s fields): (full size, --small).
WORKLOADS = {
    "trace_batch": (8, 2),
    "trace_tokens": (512, 64),
    "calls": (10, 5),
    "harvest_rows": (64, 16),
    "harvest_tokens": (512, 64),
    "harvest_batch": (8, 4),
    "prompts": (64, 64),
    "prompt_tokens": (32, 16),
    "new_tokens": (64, 16),
    "prefill_prompts": (128, 32),
    "prefill_tokens": (512, 128),
    "checked_prompts": (8, 4),
}


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer whose vocabulary is exactly ``vocab_size`` tokens: ``<pad> <s> </s> <unk> w4 w5 ...``."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    words = [*specials.values(), *(f"w{i}" for i in range(len(specials), vocab_size))]
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel({word: i for i, word in enumerate(words)}, "<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=model, **specials)


def random_llama(sizes: dict[str, int], dtype: str) -> Path:
    """A random-weight Llama checkpoint of ``sizes`` stored in ``dtype``, with `word_tokenizer`, built once (on the
    GPU where there is one) into the package's cache directory; its directory."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from nnterp_vllm.checkpoints import cache_dir

    key = json.dumps([sizes, dtype, transformers.__version__], sort_keys=True).encode()
    path = cache_dir() / "benchmark-models" / f"llama-{hashlib.sha256(key).hexdigest()[:12]}"
    if (path / "config.json").exists():
        return path
    config = LlamaConfig(**sizes, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    staging = path.with_name(f"{path.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    word_tokenizer(config.vocab_size).save_pretrained(staging)
    staging.rename(path)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the engines built next in this process see the whole GPU
    return path


def checkpoint(args: argparse.Namespace) -> Path:
    """The model both halves load: ``--model``, or the random Llama of this scale."""
    if args.model:
        return Path(args.model)
    return random_llama(scale(args).model, "float32" if args.small else "bfloat16")


def scale(args: argparse.Namespace) -> Scale:
    """The sizes ``args`` ask for: full, or ``--small``."""
    column = int(args.small)
    return Scale(
        model={key: sizes[column] for key, sizes in LLAMA.items()},
        **{key: sizes[column] for key, sizes in WORKLOADS.items()},
    )


def random_rows(vocab_size: int, rows: int, tokens: int, seed: int) -> list[list[int]]:
    """``rows`` lists of ``tokens`` token ids drawn from a seeded generator, special ids (below 4) left out."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab_size, (rows, tokens), generator=generator).tolist()


def model_line(path: Path) -> str:
    """The model's shape, in one line."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path).get_text_config()
    return (
        f"model {path}: {config.num_hidden_layers} blocks, "
        f"hidden {config.hidden_size}, {config.num_attention_heads} heads / {config.num_key_value_heads} KV heads, "
        f"vocabulary {config.vocab_size}"
    )
