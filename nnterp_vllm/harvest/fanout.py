"""Ray fan-out: one model replica per actor, each computing and writing a disjoint share of the shards.

A replica split by tensor parallelism (vLLM's ``tensor_parallel_size=T``) holds T of Ray's CPUs and runs its T
ranks on its own node (vLLM's multiprocessing executor, its threads placed there); Ray spreads the replicas over
the nodes (``SPREAD``) rather than packing them onto one. Each replica shuts its engine down before it goes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .compute import Job, Unit, load_model, run_unit


class ShardWorker:
    """A Ray actor holding one model replica; computes and writes the shards it is handed."""

    def __init__(self, checkpoint: str, engine: str, model_kwargs: dict[str, Any], job: Job) -> None:
        self.model = load_model(checkpoint, engine, model_kwargs)
        self.job = job

    def run(self, unit: Unit) -> tuple[int, dict[str, Any]]:
        return unit.index, run_unit(self.model, unit, self.job)

    def close(self) -> None:
        """Shut the replica's engine down (its processes, shared memory and socket files go with it)."""
        shutdown = getattr(self.model, "shutdown", None)
        if shutdown is not None:
            shutdown()


#: Seconds a replica gets to shut its engine down before it is killed.
CLOSE_TIMEOUT = 120


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
    """Run ``units`` on ``workers`` replicas (on the cluster at ``address``, else a private one), two in flight each.

    Each replica is an actor holding as many of Ray's CPUs as its model has tensor-parallel ranks, its engine
    built from ``model_kwargs``; the replicas are spread over the cluster's nodes. ``finished(index, record)``
    runs on the driver as each shard lands, in completion order.
    """
    import ray

    from ..ray_cluster import join

    ranks = int(model_kwargs.get("tensor_parallel_size") or 1) if engine == "vllm" else 1
    session = join(address, num_cpus=workers * ranks, log_to_driver=False)
    replica = ray.remote(num_cpus=ranks, scheduling_strategy="SPREAD")(ShardWorker)
    actors = [replica.remote(checkpoint, engine, model_kwargs, job) for _ in range(workers)]
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
        closing = [actor.close.remote() for actor in actors]
        ray.wait(closing, num_returns=len(closing), timeout=CLOSE_TIMEOUT)
        for actor in actors:
            ray.kill(actor)
        session.stop()


def _collect(ray: Any, pending: dict[Any, Any], finished: Callable[[int, dict[str, Any]], None]) -> Any:
    [ready], _ = ray.wait(list(pending), num_returns=1)
    actor = pending.pop(ready)
    finished(*ray.get(ready))
    return actor
