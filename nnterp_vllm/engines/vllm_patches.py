"""What vLLM, torch and transformers are made to do while nnsight builds its module tree and loads a model: no-op
accelerator calls and unpacked expert weights in the weightless meta build on the CPU build, and transformers' model
classes given back what vLLM's Transformers backend patched into them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .vllm_platform import is_cpu_platform

__all__ = ["accelerator_noop", "transformers_classes_kept"]


@contextlib.contextmanager
def accelerator_noop() -> Iterator[None]:
    """Make ``torch.accelerator.synchronize``/``empty_cache`` no-ops inside the block, on CPU only.

    Uses vLLM's own ``_set_torch_accelerator_to_noop`` (what its ``CPUModelRunner`` runs in its
    constructor). On exit the originals come back unless something replaced the no-ops meanwhile:
    an in-process CPU engine built inside the block installs its own, permanently, and relies on
    them afterwards. Elsewhere (CUDA, ROCm, ...) this does nothing.
    """
    if not is_cpu_platform():
        yield
        return
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    names = ("synchronize", "empty_cache")
    originals = {name: getattr(torch.accelerator, name) for name in names}
    _set_torch_accelerator_to_noop()
    installed = {name: getattr(torch.accelerator, name) for name in names}
    try:
        yield
    finally:
        for name in names:
            if getattr(torch.accelerator, name) is installed[name]:
                setattr(torch.accelerator, name, originals[name])


@contextlib.contextmanager
def meta_moe_weights_unpacked() -> Iterator[None]:
    """Leave mixture-of-experts weights unpacked in the weightless meta build, on CPU only.

    vLLM's CPU MoE layers prepack their weights after loading with a kernel that has no meta
    implementation; the meta copy only gives nnsight the module tree, so its weights stay as built.
    """
    if not is_cpu_platform():
        yield
        return
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    prepack = cpu_moe.cpu_prepack_moe_weight

    def prepack_real_weights(weight: torch.Tensor, isa: str) -> torch.Tensor:
        return weight if weight.is_meta else prepack(weight, isa)

    cpu_moe.cpu_prepack_moe_weight = prepack_real_weights
    try:
        yield
    finally:
        cpu_moe.cpu_prepack_moe_weight = prepack


@contextlib.contextmanager
def transformers_classes_kept() -> Iterator[None]:
    """Give transformers' model classes back, on the way out, what vLLM's Transformers backend patched into them.

    To run an architecture it has no code of its own for, vLLM builds transformers' own model and marks its
    decoder class (``OlmoModel``, ...) for torch.compile by patching the class itself, for the whole process: its
    ``__init__`` then asks for a current vLLM config, so the class no longer builds outside vLLM and a
    `StandardizedTransformer` of the same architecture in the same process fails. The instances built inside the
    block keep what the patch gave them (eager engines never compile them); the classes get their own attributes
    back. The compile wrapper vLLM appends to their bases stays (its hooks refer to the instances built): every
    name it defines is shadowed by ``torch.nn.Module``'s or unused outside vLLM.
    """
    from vllm.compilation import decorators

    mark = decorators._support_torch_compile
    marked: list[tuple[type, dict[str, Any]]] = []

    def marking(cls: type, *args: Any, **kwargs: Any) -> type:
        if cls.__module__.startswith("transformers."):
            marked.append((cls, dict(vars(cls))))
        return mark(cls, *args, **kwargs)

    decorators._support_torch_compile = marking
    try:
        yield
    finally:
        decorators._support_torch_compile = mark
        for cls, namespace in reversed(marked):
            for name in set(vars(cls)) - set(namespace):
                delattr(cls, name)
            for name, value in namespace.items():
                if name not in ("__dict__", "__weakref__") and vars(cls).get(name) is not value:
                    setattr(cls, name, value)
