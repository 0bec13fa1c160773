"""Ray fan-out: one model replica per actor, each computing and writing a disjoint share of the shards.

Each replica writes its shards straight to the harvest's location: an object store (every node reaches it), or a
local path, which is refused where a replica could run on another node than this one's (its shards would land on
that node's disk), unless declared a file system every node shares; then each landed shard is checked here.

A replica split by tensor parallelism (vLLM's ``tensor_parallel_size=T``) holds T of Ray's CPUs and runs its T
ranks on its own node (vLLM's multiprocessing executor, its threads placed there); Ray spreads the replicas over
the nodes (``SPREAD``) rather than packing them onto one. Each replica shuts its engine down before it goes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .compute import Job, Unit, load_model, run_unit
from .store import HarvestError


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
    shared_filesystem: bool = False,
) -> None:
    """Run ``units`` on ``workers`` replicas (on the cluster at ``address``, else a private one), two in flight each.

    Each replica is an actor holding as many of Ray's CPUs as its model has tensor-parallel ranks, its engine
    built from ``model_kwargs``; the replicas are spread over the cluster's nodes. ``finished(index, record)``
    runs on the driver as each shard lands, in completion order. A local ``job.out`` is refused before any
    replica starts where one could run on another node (`check_nodes`), unless ``shared_filesystem``; then each
    landed shard is checked where the driver reads it.
    """
    import ray

    from ..ray_cluster import join

    ranks = int(model_kwargs.get("tensor_parallel_size") or 1) if engine == "vllm" else 1
    session = join(address, num_cpus=workers * ranks, log_to_driver=False)
    location = job.location()
    try:
        if location.local is not None and not shared_filesystem:
            check_nodes(ray, str(location.local), ranks)
    except BaseException:
        session.stop()
        raise
    if location.local is not None and shared_filesystem:
        finished = _checked(location, finished)
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


def check_nodes(ray: Any, out: str, ranks: int) -> None:
    """Refuse a local ``out`` where a replica of ``ranks`` CPUs could run on another node than the driver's."""
    here = ray.get_runtime_context().get_node_id()
    able = [node for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) >= ranks]
    elsewhere = [node for node in able if node["NodeID"] != here]
    if elsewhere:
        raise HarvestError(
            f"--out {out} is a local directory, and {len(elsewhere)} other node(s) of this Ray cluster "
            f"({', '.join(node['NodeManagerAddress'] for node in elsewhere)}) can run a replica, which would write "
            "its shards to that node's own disk. Write to an object store every node reaches (--out "
            f"s3://bucket/run, or any fsspec URL), or, if {out} is a file system every node mounts at the same "
            "path, declare it with --shared-filesystem (shared_filesystem=True)."
        )


def _checked(location: Any, finished: Callable[[int, dict[str, Any]], None]) -> Callable[[int, dict[str, Any]], None]:
    """``finished``, once the shard a replica wrote on a declared shared file system is seen here, whole."""

    def check(index: int, record: dict[str, Any]) -> None:
        found = location.head(record["file"])
        if found is None or found[0] != record["bytes"]:
            seen = "is missing" if found is None else f"holds {found[0]} bytes, not {record['bytes']}"
            raise HarvestError(
                f"{record['file']} was written by a replica, but {location.path(record['file'])} {seen} on this "
                "machine: --out is not a file system every node shares at that path. Write to an object store "
                "(--out s3://bucket/run), or mount the same file system at the same path on every node."
            )
        finished(index, record)

    return check


def _collect(ray: Any, pending: dict[Any, Any], finished: Callable[[int, dict[str, Any]], None]) -> Any:
    [ready], _ = ray.wait(list(pending), num_returns=1)
    actor = pending.pop(ready)
    finished(*ray.get(ready))
    return actor
