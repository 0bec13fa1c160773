"""Tensor-parallel requests on either engine: how many ranks, and whether the model's heads split that many ways."""

from __future__ import annotations

import os
from typing import Any

#: torchrun's (and every launcher's) variable holding the number of processes started.
WORLD_SIZE = "WORLD_SIZE"


def as_distributed_config(kwargs: dict[str, Any]) -> None:
    """Turn transformers' standalone ``tp_plan`` / ``tp_size`` loading arguments into the ``distributed_config``
    they stand for, in ``kwargs`` (so nnsight, which reads only that, merges its tensor-parallel envoys and checks
    the degree). A bare ``tp_plan`` shards over every process the launcher started (``WORLD_SIZE``), as
    transformers does; that number is written in, so the degree is known before loading."""
    if "tp_plan" not in kwargs and "tp_size" not in kwargs:
        return
    if kwargs.get("distributed_config") is not None:
        raise ValueError("pass either distributed_config= or tp_plan= / tp_size=, not both")
    from transformers import DistributedConfig

    plan, size = kwargs.pop("tp_plan", None), kwargs.pop("tp_size", None)
    if plan is None and size is None:
        return
    if size is None:
        size = int(os.environ.get(WORLD_SIZE, "1"))
    kwargs["distributed_config"] = DistributedConfig(tp_plan=plan, tp_size=size)


def transformers_degree(kwargs: dict[str, Any]) -> int:
    """The tensor-parallel degree a transformers load with ``kwargs`` asks for (1 for none); ValueError where the
    processes this launcher started (``WORLD_SIZE``) cannot hold it."""
    config = kwargs.get("distributed_config")
    size = (config.get("tp_size") if isinstance(config, dict) else getattr(config, "tp_size", None)) or 1
    world = int(os.environ.get(WORLD_SIZE, "1"))
    if size > 1 and world % size:
        raise ValueError(
            f"tensor parallel over {size} ranks needs one process per rank: launch with "
            f"`torchrun --nproc-per-node {size} ...` (this process is one of {world})"
        )
    return size


def check_heads_split(config: Any, size: int, *, replicated_kv: bool) -> None:
    """Refuse a tensor-parallel degree ``size`` that does not split the model's attention heads evenly, naming the
    degrees that do. ``replicated_kv``: the engine copies key/value heads onto several ranks where there are fewer
    of them than ranks (vLLM does; transformers splits them like the query heads)."""
    if size <= 1:
        return
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(heads, int):
        return
    kv_heads = getattr(text, "num_key_value_heads", None) or heads

    def splits(ways: int) -> bool:
        return heads % ways == 0 and (kv_heads % ways == 0 or (replicated_kv and ways % kv_heads == 0))

    if not splits(size):
        ways = [str(ways) for ways in range(1, heads + 1) if splits(ways)]
        listed = f"{', '.join(ways[:-1])} or {ways[-1]}" if len(ways) > 1 else ways[0]
        raise ValueError(
            f"tensor parallel over {size} ranks cannot split this model's {heads} attention heads and {kv_heads} "
            f"key/value heads evenly: it splits {listed} ways"
        )
