"""How a trace runs on either engine: one at a time per model, whatever the thread, handing back what it saved.

Two misuses that would break a model (on vLLM: kill its engine) are refused with the fix: a trace opened
inside a running trace, and ``.stop()`` called on a value.
"""

from __future__ import annotations

import re
import threading
import weakref
from types import CodeType
from typing import Any

from greenlet import getcurrent
from nnsight.intervention.tracer import InterleavingTracer
from nnsight.intervention.util import shared_locals
from nnsight.tracing.tracer import push_result

from .saving import hand_back_shared

_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()

NESTED_TRACE = (
    "a trace cannot be opened inside a running trace: the body of `with model.trace(...)` runs inside the "
    "model's forward pass (on vLLM inside its engine), where no second pass can start. Open the second trace "
    "after the first one ends, or run several prompts in one trace with `tracer.invoke(prompt)`"
)
#: How an AttributeError names a missing ``stop`` (raised here, or carried back from vLLM's engine as text).
_NO_STOP = re.compile(r"'(\w+)' object has no attribute 'stop'")


def model_lock(model: Any) -> threading.RLock:
    """The lock a model's traces run under (re-entrant: a trace may open another on the same model)."""
    with _GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


def in_a_trace_body() -> bool:
    """Whether the caller runs as a trace's body (nnsight runs every body in a greenlet holding its mediator)."""
    return getattr(getcurrent(), "mediator", None) is not None


def clearer_stop_error(error: AttributeError) -> AttributeError:
    """``error`` itself, or, where it says a value has no ``stop``, one that says how a forward pass stops early."""
    found = _NO_STOP.search(str(error))
    if found is None:
        return error
    return AttributeError(
        f"a value has no .stop() (here it is a plain {found.group(1)}): to end the forward pass early, call the "
        "tracer's stop() after the last value you need, e.g. "
        "`with model.trace(prompt) as tracer: out = model.layers[2].output.save(); tracer.stop()`"
    )


class OneAtATime:
    """A tracer mixin: a model runs one trace at a time; a trace from another thread waits for the running one.

    A model's interleaver (its workers, its batch) is one per model, so two traces running at once
    from two threads would share it and break each other. The containers of saved values the trace
    body bound beside its invokes are handed back too (`saving`). A trace opened in another trace's
    body is refused as it is made (``ValueError``), and ``.stop()`` on a value says what stops a pass.
    """

    envoy: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if in_a_trace_body():
            raise ValueError(NESTED_TRACE)
        super().__init__(*args, **kwargs)

    def execute(self, code: CodeType) -> None:
        frame = self.info.frame  # type: ignore[attr-defined]
        # The scope the trace body's own bindings land in (one object until the trace ends).
        shared = shared_locals(frame)
        try:
            with model_lock(self.envoy):
                super().execute(code)  # type: ignore[misc]
        except AttributeError as error:
            clearer = clearer_stop_error(error)
            if clearer is error:
                raise
            raise clearer from None
        push_result(frame, hand_back_shared(shared))


class Tracer(OneAtATime, InterleavingTracer):
    """nnsight's tracer for a local model, one trace at a time per model."""
