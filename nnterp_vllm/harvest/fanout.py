"""Ray fan-out: one model replica per actor, each computing and writing a disjoint share of the shards."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from .run import Job, Unit, load_model, run_unit


class ShardWorker:
    """A Ray actor holding one model replica; computes and writes the shards it is handed."""

    def __init__(self, checkpoint: str, engine: str, model_kwargs: dict[str, Any], job: Job) -> None:
        self.model = load_model(checkpoint, engine, model_kwargs)
        self.job = job

    def run(self, unit: Unit) -> tuple[int, dict[str, Any]]:
        return unit.index, run_unit(self.model, unit, self.job)


def run_on_ray(
    units: Iterator[Unit],
    job: Job,
    workers: int,
    address: str | None,
    checkpoint: str,
    engine: str,
    model_kwargs: dict[str, Any],
    finished: Callable[[int, dict[str, Any]], None],
) -> None:
    """Run ``units`` on ``workers`` actors (on the cluster at ``address``, else a local one), two in flight each.

    ``finished(index, record)`` runs on the driver as each shard lands, in completion order.
    """
    import ray

    started = not ray.is_initialized()
    session = None
    if started:
        options: dict[str, Any] = {"address": address, "include_dashboard": False, "log_to_driver": False}
        if address is None:
            # A local cluster of our own: no auth token under the home directory, and its session
            # files in a directory removed when it stops.
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            session = tempfile.mkdtemp(prefix="nnterp-ray-")
            options.update(num_cpus=workers, _temp_dir=session)
        ray.init(**options)
    actors = [ray.remote(num_cpus=1)(ShardWorker).remote(checkpoint, engine, model_kwargs, job) for _ in range(workers)]
    pending: dict[Any, Any] = {}
    idle = [actor for actor in actors for _ in range(2)]
    try:
        for unit in units:
            if not idle:
                idle.append(_collect(ray, pending, finished))
            actor = idle.pop()
            pending[actor.run.remote(unit)] = actor
        while pending:
            _collect(ray, pending, finished)
    finally:
        for actor in actors:
            ray.kill(actor)
        if started:
            ray.shutdown()
        if session is not None:
            shutil.rmtree(session, ignore_errors=True)


def _collect(ray: Any, pending: dict[Any, Any], finished: Callable[[int, dict[str, Any]], None]) -> Any:
    [ready], _ = ray.wait(list(pending), num_returns=1)
    actor = pending.pop(ready)
    finished(*ray.get(ready))
    return actor
