"""After ``shutdown()``: every use of an engine says it was shut down, instead of failing deep inside vLLM."""

from __future__ import annotations

from typing import Any

from ..errors import EngineShutDown
from .lifecycle import shutdown_llm

#: The parts of a ``vllm.LLM`` its methods reach the engine through.
LLM_PARTS = ("llm_engine", "renderer", "input_processor")


def shut_down(owner: str) -> EngineShutDown:
    """The error a use of ``owner`` (a class name) after its ``shutdown()`` raises."""
    return EngineShutDown(
        f"{owner}: this engine was stopped by shutdown(); build a new {owner} to use one again "
        "(its sizes and config still answer)"
    )


class ShutDownPart:
    """Stands in for a part of a shut-down engine: any attribute of it raises `EngineShutDown`."""

    def __init__(self, owner: str) -> None:
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_owner":  # copy, pickle and introspection find nothing here
            raise AttributeError(name)
        raise shut_down(self._owner)


def shut_down_llm(llm: Any, owner: str) -> None:
    """Shut down the engine behind a ``vllm.LLM`` (idempotent); its later uses raise `EngineShutDown`."""
    if isinstance(llm.llm_engine, ShutDownPart):
        return
    shutdown_llm(llm)
    for name in LLM_PARTS:
        setattr(llm, name, ShutDownPart(owner))


def refuse_after_shutdown(engine: Any, owner: str) -> None:
    """Raise `EngineShutDown` where ``engine`` (marked ``_shut_down`` by its ``shutdown()``) is shut down."""
    if getattr(engine, "_shut_down", False):
        raise shut_down(owner)
