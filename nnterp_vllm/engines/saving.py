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

from collections.abc import Iterable, Mapping
from typing import Any

from nnsight.tracing.tracer import _saves, mark

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
