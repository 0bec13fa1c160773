"""The vLLM environment settings every engine of this library is built under: vLLM's V1 model runner, and compiled
models without vLLM's ahead-of-time artifact."""

from __future__ import annotations

import logging
import os

from .vllm_platform import is_cpu_platform

__all__ = ["choose_model_runner", "no_saved_graphs", "reuse_compiled_models"]

logger = logging.getLogger(__name__)

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
