"""The keyword arguments an engine of this library is built with on this platform: the dtype the library loads the
checkpoint in, and on vLLM's CPU build the executor and a KV cache sized for the checkpoint's context."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..checkpoints import read_config_with
from ..dtypes import VLLM as VLLM_ENGINE
from ..dtypes import given, load_dtype, requested
from ..dtypes import name as dtype_name
from .vllm_platform import is_cpu_platform

__all__ = ["CPU_KV_CACHE_BYTES", "TAKEN", "engine_kwargs"]

logger = logging.getLogger(__name__)

#: KV cache given to a CPU engine unless the caller sizes it. Without an explicit size vLLM's CPU
#: worker reserves ``gpu_memory_utilization`` (0.92) of the NUMA node's memory and fails.
CPU_KV_CACHE_BYTES = 64 * 2**20


def engine_kwargs(checkpoint: str | None = None, config: Any = None, /, **user_kwargs: Any) -> dict[str, Any]:
    """The keyword arguments to build an nnsight vLLM model with, on this platform. ``config``: ``checkpoint``'s,
    where the caller has read it already (`checkpoints.read_config`; read here otherwise).

    On every platform, ``dtype`` is the one the library loads ``checkpoint`` in (`dtypes.load_dtype`: the
    caller's ``dtype=`` or ``torch_dtype=``, else the checkpoint's own, as on transformers), never vLLM's
    ``"auto"``, which would run a float32 checkpoint in bfloat16.

    On vLLM's CPU platform, unless the caller sized the KV cache (``kv_cache_memory_bytes``, or
    ``VLLM_CPU_KVCACHE_SPACE`` in the environment), this sizes it: for ``checkpoint``'s context
    (`cpu_kv_cache`), or ``CPU_KV_CACHE_BYTES`` without one; and it picks the executor that places
    the ranks' threads and runs Ray ranks there (`cpu_executor`). Elsewhere the caller's kwargs come
    back unchanged (a new dict), ``ray_address`` refused.

    ``worker_cls`` is deliberately not among them: nnsight passes its own ``worker_cls`` to
    ``vllm.LLM`` beside these kwargs, so a second one raises ``TypeError``. Build with
    :class:`PlatformVLLM`, which carries the CPU worker as a class attribute and applies these
    defaults itself; with nnsight's plain ``VLLM`` these kwargs alone do not make the CPU build work.
    """
    kwargs = dict(user_kwargs)
    if checkpoint is not None:
        if config is None:
            config = read_config_with(checkpoint, kwargs)
        kwargs["dtype"] = load_dtype(checkpoint, config, kwargs, VLLM_ENGINE)
    else:
        spelling, value = given(kwargs)
        dtype = requested(value, VLLM_ENGINE, spelling)
        if value is not None:
            kwargs["dtype"] = value if dtype is None else dtype_name(dtype)
    if not is_cpu_platform():
        if "ray_address" in kwargs:
            raise ValueError(
                "ray_address= is taken on vLLM's CPU build; on GPUs vLLM's own Ray executor joins the cluster "
                "RAY_ADDRESS names"
            )
        return kwargs
    if "worker_cls" in kwargs:
        raise TypeError(
            "worker_cls cannot be passed to nnsight's VLLM: it passes its own to vllm.LLM. "
            "Use PlatformVLLM, whose _WORKER_CLS is the CPU worker on this platform."
        )
    kwargs.update(cpu_executor(kwargs))
    if "kv_cache_memory_bytes" in kwargs or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return kwargs
    if checkpoint is None:
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        return kwargs
    return {**kwargs, **cpu_kv_cache(config, kwargs)}


#: Keyword arguments `engine_kwargs` takes for itself: vLLM has no such engine argument.
TAKEN = ("ray_address", "torch_dtype")


def cpu_executor(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The executor settings of a CPU engine built with ``kwargs`` (`cpu_executors`), taking ``ray_address``.

    ``distributed_executor_backend="ray"`` becomes `CPURayExecutor` (joining ``ray_address``, else
    ``RAY_ADDRESS``, else a private local cluster); no backend or ``"mp"`` becomes `CPUMultiprocExecutor`
    wherever vLLM would start worker processes (several ranks, ``tensor_parallel_size`` x
    ``pipeline_parallel_size``, or one rank of an engine in its own process, where vLLM's CPU build runs its
    multiprocessing executor too): it splits this machine's CPUs among several ranks unless
    ``VLLM_CPU_OMP_THREADS_BIND`` is set, and leaves no file behind. ``ray_address`` is removed from ``kwargs``
    (vLLM has no such argument) and, with another backend, refused.
    """
    backend = kwargs.get("distributed_executor_backend")
    address = kwargs.pop("ray_address", None)
    ranks = int(kwargs.get("tensor_parallel_size") or 1) * int(kwargs.get("pipeline_parallel_size") or 1)
    if address is not None and backend != "ray":
        raise ValueError(f"ray_address={address!r} needs distributed_executor_backend='ray', got {backend!r}")
    if backend == "ray":
        from .cpu_executors import RAY_ADDRESS_KEY, CPURayExecutor

        settings: dict[str, Any] = {"distributed_executor_backend": CPURayExecutor}
        if address is not None:
            settings["additional_config"] = {**(kwargs.get("additional_config") or {}), RAY_ADDRESS_KEY: address}
        return settings
    in_own_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1"
    if backend in (None, "mp") and (ranks > 1 or in_own_process):
        from .cpu_executors import CPUMultiprocExecutor

        return {"distributed_executor_backend": CPUMultiprocExecutor}
    return {}


#: The CPU KV cache sizing: room for this many full-length sequences, within `CPU_KV_CACHE_CAP`
#: and a quarter of the memory available when the engine is built.
CPU_KV_SEQUENCES = 4
CPU_KV_CACHE_CAP = 4 * 2**30
#: vLLM's CPU KV cache is allocated in blocks of this many tokens.
CPU_KV_BLOCK = 128


def kv_bytes_per_token(config: Any, dtype: Any) -> int | None:
    """Bytes of KV cache one token takes: keys and values of every layer's key/value heads (``None`` when the
    config does not say its sizes in the usual way)."""
    text = config.get_text_config()
    layers, heads, kv_heads, head_dim, hidden = (
        _global_size(text, name)
        for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")
    )
    kv_heads = kv_heads or heads
    head_dim = head_dim or (hidden // heads if heads and hidden else None)
    if not all(isinstance(size, int) and size > 0 for size in (layers, kv_heads, head_dim)):
        return None
    if dtype in (None, "auto"):
        dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), torch.float32)
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _global_size(config: Any, name: str) -> Any:
    """``config.name``, or ``None`` where the config lacks it or holds it per layer (a heterogeneous config
    refuses global access to a size that varies across layers)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError and kin
        return None


def cpu_kv_cache(config: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """KV-cache settings for the checkpoint whose config is ``config`` on the CPU build, where vLLM has no memory
    profile to size it by.

    Room for `CPU_KV_SEQUENCES` sequences of ``max_model_len`` tokens (the model's context unless
    given), at least ``CPU_KV_CACHE_BYTES``, at most `CPU_KV_CACHE_CAP` or a quarter of available
    memory. Where not even one full-length sequence fits that budget and the caller left
    ``max_model_len`` unset, it is lowered to what the budget holds, and a log line says so once.
    """
    import psutil

    from ..standardized import max_positions

    per_token = kv_bytes_per_token(config, kwargs.get("dtype"))
    context = kwargs.get("max_model_len") or max_positions(config)
    if per_token is None or context is None:
        return {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}
    budget = max(CPU_KV_CACHE_BYTES, min(CPU_KV_CACHE_CAP, psutil.virtual_memory().available // 4))
    blocks = -(-context // CPU_KV_BLOCK)
    one_sequence = blocks * CPU_KV_BLOCK * per_token
    if one_sequence <= budget or "max_model_len" in kwargs:
        return {"kv_cache_memory_bytes": min(budget, max(CPU_KV_CACHE_BYTES, CPU_KV_SEQUENCES * one_sequence))}
    fits = budget // per_token // CPU_KV_BLOCK * CPU_KV_BLOCK
    logger.warning(
        "max_model_len lowered from %d to %d tokens: a full-length sequence needs %.2f GiB of KV cache, more than "
        "the CPU build's default budget of %.2f GiB (a quarter of available memory, at most %d GiB). "
        "Pass max_model_len= or kv_cache_memory_bytes= to choose.",
        context,
        fits,
        one_sequence / 2**30,
        budget / 2**30,
        CPU_KV_CACHE_CAP // 2**30,
    )
    return {"kv_cache_memory_bytes": budget, "max_model_len": fits}


#: The share of an accelerator a `PlatformVLLM` (the nnsight engine of a notebook) takes unless told: it shares
#: its device with other models (a transformers model, an SAE), where vLLM's own default is for an engine alone.
NOTEBOOK_GPU_MEMORY_UTILIZATION = 0.5


def notebook_share(kwargs: dict[str, Any], engine: str) -> dict[str, Any]:
    """``kwargs`` of a notebook ``engine`` with the share of an accelerator it takes unless the caller sized it
    (`NOTEBOOK_GPU_MEMORY_UTILIZATION`, said in a log line); unchanged on the CPU build or where sized."""
    if is_cpu_platform() or "gpu_memory_utilization" in kwargs or "kv_cache_memory_bytes" in kwargs:
        return kwargs
    logger.info(
        "%s takes at most %d%% of the device (gpu_memory_utilization=%s), leaving room for other models in this "
        "process; pass gpu_memory_utilization= (or kv_cache_memory_bytes=) to choose",
        engine,
        round(100 * NOTEBOOK_GPU_MEMORY_UTILIZATION),
        NOTEBOOK_GPU_MEMORY_UTILIZATION,
    )
    return {**kwargs, "gpu_memory_utilization": NOTEBOOK_GPU_MEMORY_UTILIZATION}
