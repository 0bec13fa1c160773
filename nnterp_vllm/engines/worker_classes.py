"""The engines' worker and model-runner classes by name: the dotted path vLLM imports in each worker process, the
worker's check that it built vLLM's V1 runner, and how the module holding them (`runners`) publishes the classes it
builds on first access (PEP 562 ``__getattr__``)."""

from __future__ import annotations

import os
from typing import Any

from .vllm_environment import RUNNER_SETTING
from .vllm_platform import is_cpu_platform

__all__ = ["worker_class"]

#: The module of the engines' worker and model-runner classes (`runners`), and the classes it builds on first
#: access: the CPU build's pair on its platform, the GPU pair elsewhere.
RUNNERS_MODULE = "nnterp_vllm.engines.steered.runners"
WORKER_CLASSES = ("EngineCPUWorker", "EngineGPUWorker", "EngineCPUModelRunner", "EngineGPUModelRunner")


def worker_class() -> str:
    """The dotted path of the worker every engine of this library runs on this platform (vLLM imports it in each
    worker process): `runners`' worker over vLLM's ``CPUWorker`` on the CPU build, its GPU ``Worker`` elsewhere."""
    return f"{RUNNERS_MODULE}.Engine{'CPU' if is_cpu_platform() else 'GPU'}Worker"


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
