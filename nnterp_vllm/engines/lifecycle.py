"""An engine's lifetime in this process: the directory of its IPC socket files, and its shutdown."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

__all__ = ["shutdown", "shutdown_llm"]

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
