"""Which vLLM platform this process runs on, as vLLM decided it."""

from __future__ import annotations

import functools

__all__ = ["is_cpu_platform"]


@functools.cache
def is_cpu_platform() -> bool:
    """Whether vLLM's current platform is its CPU platform (False when vLLM is not installed).

    vLLM decides its platform once per process from the installed build and the hardware; this
    reads that decision (``vllm.platforms.current_platform.is_cpu()``) rather than any setting.
    """
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())
