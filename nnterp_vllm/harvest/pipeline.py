"""The in-engine harvest as one stream: the engine fed across shard boundaries, each shard's rows kept in place.

`shards` keeps at least `FEED_STEPS` engine steps' worth of tokens in the engine, opening as many shards as that
takes (a shard's requests are added all at once), so the next shard's rows are scheduled while the last requests
of the one before finish (the engine never drains at a shard's end), and steps it itself. Each open shard has its
values' region of shared memory (`engines.steered.shared_rows.SharedRows`), laid out as the shard's columns: the
engine's worker copies each step's kept rows straight to their places there, one copy per step for the requests that lie
side by side. A safetensors shard's region is the shard's file itself (begun with its header and metadata and its
disk space taken, `store.place_shard`): the rows land where the file holds them, as the worker writes them a
chunk at a time, straight to the disk where it can, hashing each chunk as it writes it
(`engines.steered.shared_rows.Region`), and writing the shard is taking the checksum over those digests and renaming it.
A safetensors shard bound for an object store is laid out the same way in a memory file (`streamed.StreamedShard`),
each of its parts sent once the worker has written all its chunks, checked after every engine step. A sae-lens
shard's region is a memory file whose columns the writer writes. A shard missing any row (a worker that could not
open its file dropped rows it held past its bound) is refused, never recorded with zeros (`lost_rows`). Nothing is
done per token, or per request beyond adding it; a shard whose requests have all finished is taken one engine step
later (its last chunks are written meanwhile), or at once where nothing else runs: one call to the worker (to take
its requests' rows, which frees them there), then handed on, in corpus order, to the writer, whose queue is bounded
(`run.BackgroundWriter`): a writer that falls behind holds the engine back only once that queue is full. A shard
with probe scores (``probes.NAME``) takes them from the worker in the same call as its rows, and is written from its
columns (its values' region a memory file): the scores exist only once its requests have finished.

Memory: the regions of the open shards and of the shards queued for writing: at most ``FEED_STEPS *
max_num_batched_tokens`` tokens' values plus ``1 + run.WRITES_QUEUED`` shards, in memory files; for
safetensors, the worker's chunks being gathered (about one per value and open shard, rows arriving in order) or
waiting for the disk (`engines.steered.shared_rows.QUEUED_CHUNKS` per shard at most), and the page cache of what goes
through it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..specs.capture import Capture
from ..specs.selection import PROBE_DTYPE, PROBES, token_shape
from .compute import Job, Unit, metadata, shard_record
from .in_engine import EngineHarvester, probes_at
from .layouts import Columns, Safetensors, layout_of
from .store import HarvestError, Placed, own_record, place_shard, stream_shard
from .streamed import StreamedShard

#: Engine steps' worth of tokens (``max_num_batched_tokens`` each) kept in the engine: one scheduling while the one
#: before runs, whatever the shards' sizes.
FEED_STEPS = 2


@dataclass
class OpenShard:
    """A shard in the engine: its unit, columns, region (in its file where ``placed``, in the memory of ``upload``
    where bound for a store; none where only probes are read), the requests still running, and the engine step after
    which none was."""

    unit: Unit
    columns: Columns
    region: Any
    names: list[str]
    placed: Path | None
    upload: StreamedShard | None = None
    #: Each request's id -> (its capture key or ``None``, its probes in engine form or ``None``, the first row of
    #: the shard that is its, how many rows it keeps).
    requests: dict[str, tuple[str | None, dict[str, Any] | None, int, int]] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)
    #: Prompt tokens of the running requests.
    tokens: int = 0
    #: The engine steps run when its last request finished (``None`` while one runs).
    done_after: int | None = None

    @property
    def file(self) -> Path | None:
        """The file its values are filled in (a memory file where bound for a store), or ``None``."""
        return self.upload.path if self.upload is not None else self.placed


def shards(
    harvester: EngineHarvester, units: Iterator[Unit], job: Job
) -> Iterator[tuple[Unit, Columns, Placed | None]]:
    """Each unit of ``units`` computed by ``harvester``'s engine, in order: its shard's columns and the file they
    filled (``None`` for a layout written from the columns); the engine fed continuously.
    Leaving early (an error, a closed generator) aborts what is still running and removes the files begun."""
    from vllm import SamplingParams

    from ..engines.steered.client import probe_scores
    from ..engines.steered.shared_rows import SharedRows
    from ..engines.steered.tensor_wire import unpack

    llm = harvester.llm
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    wanted = [selection.name for selection in job.selections if selection.probe is None]
    kinds = {kind: Capture(wanted, kind, job.dtype) for kind in ("all", "last")} if wanted else {}
    dtype = getattr(torch, job.dtype)
    names = kinds["all"].names(harvester.num_layers) if wanted else []
    read = {
        selection.name: token_shape(selection, harvester, job.context_length)
        for selection in job.selections
        if selection.probe is not None
    }
    location = job.location()
    in_place = isinstance(layout_of(job.settings), Safetensors) and not read
    feed = FEED_STEPS * harvester.llm.vllm_config.scheduler_config.max_num_batched_tokens
    opened: list[OpenShard] = []
    owner: dict[str, OpenShard] = {}
    units = iter(units)
    steps = 0

    def open_shard(unit: Unit) -> OpenShard:
        columns, kept = metadata(unit.rows, job.positions)
        counts = [len(part) for part in columns["token_ids"]]
        shape = (len(names), sum(counts), harvester.hidden_size)
        placed, upload, start = None, None, 0
        if in_place:
            room = [(name, dtype, list(shape[1:])) for name in names]
            own = own_record(shard_record(unit, columns), job.settings)
            if location.local is not None:
                placed, start = place_shard(location.local, unit.index, columns, room, own)
            else:
                upload, start = stream_shard(location, unit.index, columns, room, own)
        shard = OpenShard(unit, columns, None, names, placed, upload)
        region = shard.region = SharedRows(*shape, dtype, file=shard.file, start=start) if names else None
        columns.update({name: [region.tensor[index]] for index, name in enumerate(names)})
        # Each probe's scores, one part per request after this empty one.
        columns.update(
            {
                name: [torch.empty((0, *per_token), dtype=getattr(torch, PROBE_DTYPE))]
                for name, per_token in read.items()
            }
        )
        prompts, captures, destinations, probes, spans = [], [], [], [], []
        first = 0
        for row, count, positions in zip(unit.rows, counts, kept):
            if count:  # a row that keeps nothing is not run
                prompts.append({"prompt_token_ids": list(row.token_ids)})
                at = job.positions if isinstance(job.positions, str) else positions.nonzero().flatten().tolist()
                if wanted:
                    captures.append(kinds[at] if isinstance(at, str) else Capture(wanted, at, dtype))
                    destinations.append(region.destination(first))
                probes.append(probes_at(job.selections, at) or None)
                spans.append((first, count))
            first += count
        submitted = (
            llm.submit(prompts, params, capture=captures or None, destinations=destinations, probes=probes)
            if prompts
            else []
        )
        for (request_id, wire, probe_wire), prompt, span in zip(submitted, prompts, spans):
            shard.requests[request_id] = (None if wire is None else wire["key"], probe_wire, *span)
            shard.tokens += len(prompt["prompt_token_ids"])
            owner[request_id] = shard
        shard.running = set(shard.requests)
        if not shard.running:
            shard.done_after = steps
        return shard

    def taken(shard: OpenShard) -> tuple[dict[str, Any], dict[str, Any]]:
        """What the worker kept for ``shard``'s requests, handed over and forgotten there: rows, probe scores."""
        captured = [capture for capture, *_ in shard.requests.values() if capture is not None]
        read = [probe["key"] for _, probe, *_ in shard.requests.values() if probe is not None]
        return llm.take_captured(captured) if captured else {}, llm.take_probes(read) if read else {}

    def close(shard: OpenShard) -> None:
        if shard.region is not None:
            shard.region.close()

    def finish(shard: OpenShard) -> tuple[Columns, Placed | None]:
        kept, scores = taken(shard)
        missing = 0
        for capture, probes, first, count in shard.requests.values():
            short = 0
            if capture is not None:
                if not kept.get(capture):  # rows that never reached the shard: never recorded as zeros
                    short = count
                else:
                    rows = next(iter(kept[capture].values()))  # one request (one completion) per capture key
                    if rows is not None:  # kept by a worker that could not map the region
                        rows = {name: unpack(found) for name, found in rows.items()}
                        short = max(count - len(found) for found in rows.values())
                        shard.region.fill(first, rows, shard.names)
            for name, part in (probe_scores(probes, scores) if probes is not None else {}).items():
                if part is None or len(part) < count:
                    short = count
                else:
                    shard.columns[PROBES + name].append(part[:count])
            missing += short
        if missing:
            discard(shard)
            raise lost_rows(shard, missing)
        placed = None if shard.file is None else Placed(shard.file, shard.region.chunk_digests(), shard.upload)
        close(shard)
        return shard.columns, placed

    def discard(shard: OpenShard) -> None:
        """Let go of ``shard`` unwritten: its file removed, its upload aborted."""
        close(shard)
        if shard.placed is not None:
            shard.placed.unlink(missing_ok=True)
        if shard.upload is not None:
            shard.upload.abort()

    try:
        exhausted = False
        while True:
            while not exhausted and sum(shard.tokens for shard in opened) < feed:
                unit = next(units, None)
                exhausted = unit is None
                if unit is not None:
                    opened.append(open_shard(unit))
            if not opened:
                return
            head = opened[0]
            if head.done_after is not None and (steps > head.done_after or not any(s.running for s in opened)):
                yield head.unit, *finish(opened.pop(0))
                continue
            outputs = engine.step()
            steps += 1
            for shard in opened:
                if shard.upload is not None and shard.upload.unsent:
                    shard.upload.send_ready(shard.region.chunk_digests())
            for output in outputs:
                if output.finished and output.request_id in owner:
                    shard = owner.pop(output.request_id)
                    shard.running.discard(output.request_id)
                    shard.tokens -= len(output.prompt_token_ids)
                    if not shard.running:
                        shard.done_after = steps
    finally:
        running = [request_id for shard in opened for request_id in shard.running]
        if running:
            engine.abort_request(running, internal=True)
        for shard in opened:
            taken(shard)
            discard(shard)


def lost_rows(shard: OpenShard, missing: int) -> HarvestError:
    """The error of a shard some of whose rows never reached it (the shard is not recorded, nor written)."""
    from ..engines.steered.kept_rows import FINISHED_KEPT

    where = f"its file {shard.placed}" if shard.placed is not None else "its shared memory"
    return HarvestError(
        f"{missing} rows of shard {shard.unit.index} never reached it, so it is not recorded: the engine's worker "
        f"could not write into {where} (its log says why) and kept the rows of finished requests in its own memory, "
        f"dropping the oldest past {FINISHED_KEPT} of them. Let the engine's worker open the --out directory (run "
        "the engine on the host that holds it, with the same permissions), or harvest with smaller shards "
        "(shard_bytes / --shard-mb), then rerun the same command to resume."
    )


__all__ = ["FEED_STEPS", "lost_rows", "shards"]
