"""How a trace runs on either engine: one at a time per model, whatever the thread, handing back what it saved."""

from __future__ import annotations

import threading
import weakref
from types import CodeType
from typing import Any

from nnsight.intervention.tracer import InterleavingTracer
from nnsight.intervention.util import shared_locals
from nnsight.tracing.tracer import push_result

from .saving import hand_back_shared

_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()


def model_lock(model: Any) -> threading.RLock:
    """The lock a model's traces run under (re-entrant: a trace may open another on the same model)."""
    with _GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


class OneAtATime:
    """A tracer mixin: a model runs one trace at a time; a trace from another thread waits for the running one.

    A model's interleaver (its workers, its batch) is one per model, so two traces running at once
    from two threads would share it and break each other. The containers of saved values the trace
    body bound beside its invokes are handed back too (`saving`).
    """

    envoy: Any

    def execute(self, code: CodeType) -> None:
        frame = self.info.frame  # type: ignore[attr-defined]
        # The scope the trace body's own bindings land in (one object until the trace ends).
        shared = shared_locals(frame)
        with model_lock(self.envoy):
            super().execute(code)  # type: ignore[misc]
        push_result(frame, hand_back_shared(shared))


class Tracer(OneAtATime, InterleavingTracer):
    """nnsight's tracer for a local model, one trace at a time per model."""
