"""What a trace hands back, the same on both engines: saved values and the containers holding them.

nnsight pushes back from a trace only the objects marked with ``.save()``. A list, tuple or dict
of saved values built in the trace is not itself marked, so ``outs = [v.save() for ...]`` would
leave ``outs`` unbound; here a container holding a saved value (at any depth) counts as saved.

On vLLM a trace body runs in the engine's worker, against its own copy of every variable it
uses. A container made before the trace (or in the trace body beside the invokes) and filled
inside an invoke comes back as that copy: its new items are added to the original object, in
invoke order, so the original fills in place as it does on transformers. (With several invokes
transformers interleaves their appends in forward order; vLLM keeps each invoke's items together.)
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from nnsight.tracing.tracer import _saves, mark

from ..errors import SavedTooMuch

#: The saved name under which the worker says which names the block bound (as opposed to filled).
WRITTEN = "__nnterp_vllm_written__"
#: How deep into nested containers a saved value is looked for.
DEPTH = 4


def holds_saved(value: Any, saved: set[int], depth: int = DEPTH) -> bool:
    """Whether ``value`` is a list, tuple, dict or set holding a saved object, at most ``depth`` levels down."""
    if depth == 0 or not isinstance(value, (list, tuple, dict, set, frozenset)):
        return False
    items: Iterable[Any] = value.values() if isinstance(value, dict) else value
    return any(id(item) in saved or holds_saved(item, saved, depth - 1) for item in items)


def mark_containers(scope: Mapping[str, Any], names: Iterable[str]) -> list[str]:
    """Mark as saved each of ``names`` in ``scope`` whose value is a container holding a saved value."""
    saved = _saves()
    marked = []
    for name in names:
        value = scope.get(name)
        if value is not None and id(value) not in saved and holds_saved(value, saved):
            mark(value)
            marked.append(name)
    return marked


def hand_back(mediators: Iterable[Any]) -> None:
    """Before a trace pushes its blocks' results: mark the containers of saved values each block bound."""
    for mediator in mediators:
        mark_containers(mediator.lcls, list(mediator.lcls.written))


def hand_back_shared(shared: dict[str, Any]) -> dict[str, Any]:
    """The containers of saved values a trace body bound beside its invokes, marked saved.

    They live in the blocks' shared scope, which the trace pushed (unsaved, so not at all)
    before its invokes ran and filled them.
    """
    return {name: shared[name] for name in mark_containers(shared, list(shared))}


def mark_in_worker(mediator: Any) -> None:
    """On vLLM's worker, before it records what a block saved: count containers of saved values as saved,
    and record which names the block bound (`WRITTEN`), so the client can tell a container the
    block made from one it filled."""
    scope = mediator.lcls
    mark_containers(scope, list(scope))
    dict.__setitem__(scope, WRITTEN, sorted(scope.written))
    mark(scope[WRITTEN])


def fill_originals(
    scope: dict[str, Any], saves: dict[str, Any], lengths: dict[int, int], kept: Iterable[str] = ()
) -> None:
    """On the client: put the items a request added to a container it did not bind into the original, the one
    ``scope`` holds under that name (a block's variables, or the frame a trace was written in).

    ``saves`` is one request's saved values; the containers merged into the originals are removed
    from it (the originals, now filled, are handed back instead). ``lengths`` holds each original
    list's length before any request's items went in (filled in here on first sight). Names in ``kept`` (saved
    before the trace ran) are left as they came.
    """
    written = saves.pop(WRITTEN, None)
    if written is None:
        return
    kept = set(kept)
    for name in [name for name in saves if name not in written and name not in kept]:
        try:
            original = scope[name]
        except KeyError:
            continue
        copy = saves[name]
        if isinstance(original, list) and isinstance(copy, list):
            before = lengths.setdefault(id(original), len(original))
            if len(copy) < before:
                continue
            original.extend(copy[before:])
        elif isinstance(original, dict) and isinstance(copy, dict):
            original.update({key: item for key, item in copy.items() if key not in original})
        else:
            continue
        del saves[name]
        mark(original)
        scope[name] = original


def fill_from_outputs(mediators: list[Any], outputs: list[Any]) -> None:
    """`fill_originals` for every request of a vLLM trace, in invoke order, over the values nnsight pushes
    (each sampled sequence's); the `WRITTEN` record is taken off the values the outputs show too."""
    lengths: dict[int, int] = {}
    for mediator, output in zip(mediators, outputs):
        for saves in getattr(output, "nnsight_sequences", None) or [getattr(output, "nnsight_saves", None) or {}]:
            fill_originals(mediator.lcls, saves, lengths, mediator.presaved)
    take(outputs, WRITTEN)


def take(outputs: list[Any], name: str) -> list[Any]:
    """Take the value saved as ``name`` off every dict of saved values vLLM's ``outputs`` carry (those nnsight
    pushes and those they show: ``output.saves``, each completion's); the values taken, once each."""
    taken: dict[int, Any] = {}
    for output in outputs:
        holders = [
            output,
            getattr(output, "nnsight_saves", None),
            *(getattr(output, "nnsight_sequences", None) or []),
            *(getattr(output, "outputs", None) or []),
        ]
        for holder in holders:
            saves = holder if isinstance(holder, dict) else getattr(holder, "saves", None)
            if isinstance(saves, dict) and name in saves:
                value = saves.pop(name)
                taken[id(value)] = value
    return list(taken.values())


#: ``extra_args``' key of a trace request's bound on what it saves: ``{"trace": id, "bytes": n}``, shared by the
#: requests (invokes) of one trace.
SAVED_BYTES_KEY = "nnterp_vllm_saved_bytes"


def saved_size(value: Any, seen: set[int] | None = None, depth: int = 8) -> int:
    """Bytes ``value`` takes as a trace hands it back: each tensor's own elements (a view of a larger storage
    travels as a copy of itself), strings and bytes by length, and what containers (lists, tuples, dicts, sets) and
    objects' attributes hold, each object counted once."""
    seen = set() if seen is None else seen
    if id(value) in seen or depth < 0:
        return 0
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, dict):
        items: Iterable[Any] = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    else:
        items = getattr(value, "__dict__", {}).values()
    return sum(saved_size(item, seen, depth - 1) for item in items)


class SavedBytes:
    """On the worker: what the requests of each bounded trace have saved so far, counted as they save it (after
    every step), and each trace stopped as soon as its requests together hold more than its bound: its blocks are
    ended, their saved values dropped, and each request carries `SavedTooMuch` as its error (nnsight's runner then
    ends the request at its next step). Blocks are held weakly: a request's block goes when its request does."""

    def __init__(self) -> None:
        #: ``{trace: {mediator id: (weak reference to the mediator, bytes it holds)}}``.
        self.traces: dict[str, dict[int, tuple[Any, int]]] = {}

    def track(self, mediator: Any, bound: dict[str, Any]) -> None:
        """Count what ``mediator`` (a trace request's block) saves against ``bound`` (`SAVED_BYTES_KEY`'s value)."""
        mediator.nnterp_saved_bound = bound
        self.traces.setdefault(bound["trace"], {})[id(mediator)] = (weakref.ref(mediator), 0)

    def count(self, mediator: Any) -> None:
        """Recount what ``mediator`` saved (its saved names, `Requests.record` just noted them); stop its trace if
        the trace's requests now hold more than the bound."""
        bound = getattr(mediator, "nnterp_saved_bound", None)
        if bound is None or getattr(mediator, "nnterp_stopped", False):
            return
        held = self.traces.setdefault(bound["trace"], {})
        seen: set[int] = set()
        size = sum(saved_size(dict.get(mediator.lcls, name), seen) for name in mediator.nnsight_saved)
        held[id(mediator)] = (weakref.ref(mediator), size)
        for key, (reference, _) in list(held.items()):
            if reference() is None:
                del held[key]
        total = sum(size for _, size in held.values())
        if total > bound["bytes"]:
            error = SavedTooMuch(
                f"the trace saved {total} bytes by this step, more than this engine hands back ({bound['bytes']} bytes)"
            )
            for reference, _ in held.values():
                stop(reference(), error)
            del self.traces[bound["trace"]]


def stop(mediator: Any, error: BaseException) -> None:
    """End ``mediator``'s block with ``error`` as its request's error, and drop what it saved."""
    from greenlet import GreenletExit, getcurrent
    from nnsight.intervention.errors import capture_exception

    mediator.nnterp_stopped = True
    mediator.exception = error
    mediator.nnsight_error = capture_exception(error)
    saved = _saves()
    for name in set(getattr(mediator, "nnsight_saved", set())) | set(mediator.presaved):
        saved.discard(id(dict.get(mediator.lcls, name)))
        dict.pop(mediator.lcls, name, None)
    mediator.nnsight_saved, mediator.presaved = set(), set()
    mediator.pending = None
    if mediator.alive:
        mediator.worker.parent = getcurrent()
        mediator.worker.throw(GreenletExit)
