"""The steering pool: what a steered request takes of the engine's steering buffers, and who hands it out.

A request's specs (engine form, `specs.steering_requests.request_steering`) act on sets of its tokens (`TokenSets`: its
prompt, its generated tokens, listed prompt positions). Each distinct set is a **row**: what those tokens get at
every location (`location`: each block's ``layer_output``, what its attention and its MLP add, the stream entering
the first block). At one location a row applies the specs that act there, and that content (a patch's vector, the
added vectors summed, then each direction in order) is an **entry** of the pool, named by the digests of those
specs: rows and requests that apply the same specs at a location, at any location, share one entry. `needs` computes
both from the engine form, the same way on the client (which refuses a request larger than the pool), in the
scheduler and on the worker.

The scheduler hands rows and entries out (`SteeringPool`, held by the engine's scheduler): a waiting request is
placed before it is scheduled, each of its rows and entries at an id of the pool (content already resident is
shared, or taken back from the least recently used idle content), and written into its engine form (``PLACED``),
which reaches the worker with the request; the worker writes the content it does not hold yet (`steering_table`).
A request whose content does not fit the free room, or would make the step write more new content than the
engine's pinned staging holds, waits in the queue, as a request waits for KV blocks; once one waits, later
requests that need new content wait behind it, so none is passed over for good. Ids go back when a request
finishes; their content stays resident until another needs the room.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from ...specs.steering import EVERYWHERE
from ...specs.steering_requests import token_sets

#: The key of a request's steering (engine form) under which the scheduler writes where its content lies.
PLACED = "placed"
#: The values a spec acts at, each a run of ``num_layers`` locations (one per block), in this order; then one more
#: location, the stream entering the first block.
LOCATED_VALUES = ("layer_output", "attention_output", "mlp_output")


def locations(num_layers: int) -> int:
    """How many locations the pool's rows name an entry at, on a model of ``num_layers`` blocks."""
    return len(LOCATED_VALUES) * num_layers + 1


def location(value: str, layer: int, num_layers: int) -> int:
    """The location of block ``layer``'s ``value`` (`LOCATED_VALUES`; ``"layer_input"`` of block 0 is the last)."""
    if value == "layer_input":
        return locations(num_layers) - 1
    return LOCATED_VALUES.index(value) * num_layers + layer


def spec_locations(spec: dict[str, Any], num_layers: int) -> list[int]:
    """Where a spec in engine form acts: its value (``layer_output`` unless it names another) of each of its blocks;
    an `Ablate` at every location, every attention's and MLP's output and the stream entering the first block."""
    if spec["layers"] == EVERYWHERE:
        everywhere = [location(value, i, num_layers) for value in LOCATED_VALUES[1:] for i in range(num_layers)]
        return [*everywhere, location("layer_input", 0, num_layers)]
    return [location(spec.get("value", "layer_output"), layer, num_layers) for layer in spec["layers"]]


@dataclasses.dataclass(frozen=True)
class Needs:
    """What one request takes of the pool: each of its rows (a tuple of spec digests) with the entry it names at
    each location it acts at (`location`), each entry's specs in the order they apply, which row each of its token
    sets is (``None`` for none), and the probe columns it reads (its gates' and its probes' classes: each the block,
    weights and bias of one read), each entry's gated specs with the column each reads, and its probes' columns by
    name."""

    rows: dict[tuple, dict[int, tuple]]
    entries: dict[tuple, list[int]]
    prompt: tuple | None
    generated: tuple | None
    listed: dict[int, tuple | None]
    columns: dict[tuple, tuple[int, list[float], float]] = dataclasses.field(default_factory=dict)
    gates: dict[tuple, dict[int, tuple]] = dataclasses.field(default_factory=dict)
    probes: dict[str, list[tuple]] = dataclasses.field(default_factory=dict)


def applied_order(indices: Any, specs: list[dict[str, Any]], digests: list[str]) -> list[int]:
    """Spec ``indices`` in the order they apply: patches and ungated added vectors first (by digest: setting and
    adding commute, so any order names the same content), then each direction (and gated addition) in the request's
    order."""
    first = [i for i in indices if specs[i]["kind"] in ("add", "patch") and specs[i].get("when") is None]
    return sorted(first, key=lambda i: digests[i]) + sorted(i for i in indices if i not in first)


def needs(steering: dict[str, Any] | None, num_layers: int, probes: dict[str, Any] | None = None) -> Needs:
    """The rows, entries and probe columns a request's steering and probes (engine form, or ``None``) take on a
    model of ``num_layers`` blocks."""
    rows: dict[tuple, dict[int, tuple]] = {}
    entries: dict[tuple, list[int]] = {}
    columns: dict[tuple, tuple[int, list[float], float]] = {}
    gates: dict[tuple, dict[int, tuple]] = {}
    read = {}
    for probe in (probes or {}).get("probes", []):
        keys = [(probe["digest"], index) for index in range(len(probe["weight"]))]
        for key, weight, bias in zip(keys, probe["weight"], probe["bias"]):
            columns[key] = (probe["layer"], weight, bias)
        read[probe["name"]] = keys
    if steering is None:
        return Needs({}, {}, None, None, {}, columns, {}, read)
    specs, digests = steering["specs"], steering["digests"]
    tokens = token_sets(steering)

    def row(indices: tuple[int, ...]) -> tuple | None:
        if not indices:
            return None
        order = applied_order(indices, specs, digests)
        key = tuple(digests[i] for i in order)
        if key not in rows:
            at: dict[int, list[int]] = {}
            for i in order:
                for place in spec_locations(specs[i], num_layers):
                    at.setdefault(place, []).append(i)
            placed = {}
            for layer, applied in at.items():
                entry = tuple(digests[i] for i in applied)
                entries.setdefault(entry, applied)
                placed[layer] = entry
                for i in applied:
                    when = specs[i].get("when")
                    if when is not None:
                        column = (when["digest"], 0)
                        columns[column] = (when["layer"], when["weight"], when["bias"])
                        gates.setdefault(entry, {})[i] = column
            rows[key] = placed
        return key

    listed = {position: row(indices) for position, indices in tokens.listed.items()}
    return Needs(rows, entries, row(tokens.prompt), row(tokens.generated), listed, columns, gates, read)


def content_name(key: tuple) -> str:
    """A row's or entry's key as one string (the engine form crosses processes as plain data)."""
    return repr(key)


class Slots:
    """Ids ``first..first + capacity - 1`` of one kind of pool room (rows and entries from 1, their id 0 being the
    empty content; probe columns from 0, every one of the engine's columns a read), each holding one key's content:
    shared by the requests that use it, idle (resident, used by none, reused least recently used last) or free."""

    def __init__(self, capacity: int, first: int = 1) -> None:
        self.capacity = capacity
        self.id_of: dict[tuple, int] = {}
        self.users: collections.Counter[tuple] = collections.Counter()
        self.idle: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self.free = list(range(first + capacity - 1, first - 1, -1))

    def missing(self, keys: Any) -> list[tuple]:
        """The ``keys`` whose content is not resident."""
        return [key for key in keys if key not in self.id_of]

    def room(self, keys: Any) -> int:
        """How many new contents could be placed for a request using ``keys`` (free ids, and idle ones it does
        not use itself)."""
        return len(self.free) + sum(1 for key in self.idle if key not in keys)

    def take(self, keys: Any) -> dict[tuple, int]:
        """Place ``keys`` (their content resident, or put at a free or least recently used idle id): each key's
        id. Call only where `room` allows."""
        placed = {}
        for key in keys:
            if key not in self.id_of:
                if self.free:
                    number = self.free.pop()
                else:
                    evicted = next(iter(self.idle))
                    del self.idle[evicted]
                    number = self.id_of.pop(evicted)
                self.id_of[key] = number
            self.idle.pop(key, None)
            self.users[key] += 1
            placed[key] = self.id_of[key]
        return placed

    def give_back(self, keys: Any) -> None:
        """A request using ``keys`` is done: content no request uses any more becomes idle."""
        for key in keys:
            self.users[key] -= 1
            if self.users[key] <= 0:
                del self.users[key]
                self.idle[key] = None


class SteeringPool:
    """The scheduler's side of the pool: places each waiting request's probe columns, entries and rows before it is
    scheduled, within the room and the writes one step may stage, and takes them back when it finishes.

    A column is named by its read's digest and class; an entry by its specs' digests and the ids of the columns its
    gates read; a row by its specs' digests and the ids of the entries it names: content left resident after what it
    points at was placed elsewhere is never taken for current."""

    def __init__(self, num_layers: int, rows: int, entries: int, writes_per_step: int, columns: int = 0) -> None:
        self.num_layers = num_layers
        self.rows, self.entries, self.columns = Slots(rows), Slots(entries), Slots(columns, first=0)
        self.writes_per_step = writes_per_step
        #: Each placed request's column, entry and row keys.
        self.held: dict[str, tuple[list[tuple], list[tuple], list[tuple]]] = {}
        self.written_this_step = 0
        self.waiting_for_room = False
        #: How many times a request was passed over for want of room (a test or benchmark reads it).
        self.waits = 0

    def new_step(self) -> None:
        """A step's scheduling begins: its budget of new content is whole again."""
        self.written_this_step = 0
        self.waiting_for_room = False

    @staticmethod
    def pointing(key: tuple, points: dict[Any, tuple], ids: dict[tuple, int]) -> tuple:
        """A key of content that names other content (``points``: where it names which): its own key and the ids of
        what it names (``None`` where that is not placed yet: such content is new)."""
        return (key, tuple((at, ids.get(named)) for at, named in points.items()))

    def admit(self, request_id: str, steering: dict[str, Any] | None, probes: dict[str, Any] | None = None) -> bool:
        """Whether a waiting request (its steering and probes in engine form, or ``None``) may be scheduled now,
        placing it if it has not been: its engine forms then say, under `PLACED`, where its content lies."""
        if (steering is None and probes is None) or request_id in self.held:
            return True
        wanted = needs(steering, self.num_layers, probes)
        new_columns = self.columns.missing(wanted.columns)
        entries_now = [self.pointing(key, wanted.gates.get(key, {}), self.columns.id_of) for key in wanted.entries]
        new_entries = self.entries.missing(entries_now)
        entry_ids = {key: self.entries.id_of.get(entry) for key, entry in zip(wanted.entries, entries_now)}
        rows_now = [self.pointing(key, placed, entry_ids) for key, placed in wanted.rows.items()]
        new_rows = self.rows.missing(rows_now)
        writes = len(new_rows) + len(new_entries) + len(new_columns)
        fits = (
            len(new_rows) <= self.rows.room(rows_now)
            and len(new_entries) <= self.entries.room(entries_now)
            and len(new_columns) <= self.columns.room(wanted.columns)
        )
        staged = self.written_this_step == 0 or self.written_this_step + writes <= self.writes_per_step
        if writes and (self.waiting_for_room or not fits or not staged):
            self.waiting_for_room = True
            self.waits += 1
            return False
        columns = self.columns.take(wanted.columns)
        entry_keys = {key: self.pointing(key, wanted.gates.get(key, {}), columns) for key in wanted.entries}
        placed_entries = self.entries.take(entry_keys.values())
        entries = {key: placed_entries[entry_keys[key]] for key in wanted.entries}
        row_keys = {key: self.pointing(key, placed, entries) for key, placed in wanted.rows.items()}
        rows = self.rows.take(row_keys.values())
        self.written_this_step += writes
        self.held[request_id] = (list(wanted.columns), list(entry_keys.values()), list(row_keys.values()))
        where = {"columns": [[columns[key], content_name(key), *content] for key, content in wanted.columns.items()]}
        if probes is not None:
            probes[PLACED] = {
                **where,
                "probes": [[name, [columns[key] for key in keys]] for name, keys in wanted.probes.items()],
            }
        if steering is not None:

            def row_of(key: tuple | None) -> int:
                return 0 if key is None else rows[row_keys[key]]

            steering[PLACED] = {
                **where,
                "prompt": row_of(wanted.prompt),
                "generated": row_of(wanted.generated),
                "listed": [[position, row_of(key)] for position, key in wanted.listed.items()],
                "rows": [
                    [row_of(key), content_name(row_keys[key]), [[at, entries[entry]] for at, entry in placed.items()]]
                    for key, placed in wanted.rows.items()
                ],
                "entries": [
                    [
                        entries[key],
                        content_name(entry_keys[key]),
                        applied,
                        [[index, columns[column]] for index, column in wanted.gates.get(key, {}).items()],
                    ]
                    for key, applied in wanted.entries.items()
                ],
            }
        return True

    def release(self, request_id: str) -> None:
        """A request finished (or was aborted): its columns, entries and rows go back to the pool."""
        held = self.held.pop(request_id, None)
        if held is not None:
            self.columns.give_back(held[0])
            self.entries.give_back(held[1])
            self.rows.give_back(held[2])


__all__ = [
    "LOCATED_VALUES",
    "PLACED",
    "Needs",
    "Slots",
    "SteeringPool",
    "applied_order",
    "content_name",
    "location",
    "locations",
    "needs",
    "spec_locations",
]
