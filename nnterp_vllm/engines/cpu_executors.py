"""vLLM executors for its CPU build: thread placement per rank, Ray's ``CPU`` resource for Ray ranks, no leftovers.

`engine_kwargs` (``engine_defaults``) names one of these as ``distributed_executor_backend`` on vLLM's CPU platform
(never elsewhere: on GPUs vLLM's own executors run unchanged):

- `CPUMultiprocExecutor` for ranks in processes of their own on this machine (vLLM's ``"mp"``, which its CPU
  build also runs for one rank of an engine in its own process). vLLM binds each rank's OpenMP
  threads to CPUs of its own: by default one NUMA node per rank, which fails on a machine with fewer nodes than
  ranks. Unless ``VLLM_CPU_OMP_THREADS_BIND`` is set (the user's binding wins), the CPUs this process may run on
  (``os.sched_getaffinity``) are split into one contiguous share per rank instead (`cpu_shares`).
- `CPURayExecutor` for ``distributed_executor_backend="ray"``. vLLM's Ray executor refuses the CPU platform,
  whose Ray device key is empty; this one schedules each rank actor on a placement-group bundle of Ray's ``CPU``
  resource, binds the rank to its share of its node's CPUs (the node's CPUs split among the engine's ranks
  placed there) with as many torch threads, joins the cluster at ``additional_config[RAY_ADDRESS_KEY]`` or
  ``RAY_ADDRESS`` or starts a private one (`ray_cluster.join`), and on shutdown removes the placement group
  it made and stops what it started. Ranks on different nodes exchange tensors over ``torch.distributed``
  (vLLM's shared-memory all-reduce works within one machine only).

Both leave nothing behind, even where their ranks are killed (vLLM's own shutdown kills Ray ranks, and a
multiprocess engine's client kills its engine when it does not stop at once): once the ranks are up, each
unlinks the names of the shared memory it made or joined (its queues' ring buffers, vLLM's CPU all-reduce
segments) and the executor those of its own queues, with their IPC socket files. A ``file://`` rendezvous is
made beside the engine's sockets (`rendezvous_beside_sockets`), and a private Ray cluster's session files too.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
from collections.abc import Iterable, Iterator
from multiprocessing import resource_tracker
from typing import Any
from unittest import mock

import torch
from vllm.utils import ompmultiprocessing
from vllm.v1.executor import multiproc_executor, ray_executor_v2
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.ray_executor_v2 import RayExecutorV2, RayWorkerProc

from ..ray_cluster import RaySession, join

logger = logging.getLogger(__name__)

#: vLLM's environment variable binding each rank's threads (``"0-3|4-7"``, ``"nobind"``); when set, it wins.
THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"
#: ``additional_config`` key of the Ray cluster address a `CPURayExecutor` joins.
RAY_ADDRESS_KEY = "nnterp_vllm_ray_address"
#: Seconds the ranks get to release their shared memory once they are up.
RELEASE_TIMEOUT = 30


def cpu_shares(ranks: int, cpus: Iterable[int]) -> list[list[int]]:
    """``cpus`` split into ``ranks`` contiguous shares, as equal as they can be (the first ones one larger);
    with fewer CPUs than ranks, rank ``i`` gets CPU ``i`` modulo their number."""
    ordered = sorted(cpus)
    if len(ordered) < ranks:
        return [[ordered[rank % len(ordered)]] for rank in range(ranks)]
    size, extra = divmod(len(ordered), ranks)
    shares, start = [], 0
    for rank in range(ranks):
        end = start + size + (rank < extra)
        shares.append(ordered[start:end])
        start = end
    return shares


class PlacedThreads(ompmultiprocessing.OMPProcessManager):
    """vLLM's OpenMP set-up for the ranks it starts, with this process's CPUs split among several (`cpu_shares`)
    unless ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise (one rank keeps vLLM's binding)."""

    def _parse_omp_threads_bind_env(self) -> None:
        if THREADS_BIND in os.environ or self.local_world_size == 1:
            super()._parse_omp_threads_bind_env()
            return
        self.skip_setup = self.auto_setup = False
        self.reserved_cpu_list = []
        self.cpu_lists = cpu_shares(self.local_world_size, os.sched_getaffinity(0))
        logger.info("Rank threads bound to CPUs %s (set %s to choose)", self.cpu_lists, THREADS_BIND)


def release_shared_memory(worker: Any) -> str:
    """Run on each rank once every rank is up: unlink the names of the shared memory it made or joined (the
    segments of vLLM's CPU all-reduce, the ring buffers of the message queues it made) and its groups' queue
    socket files. What is open stays valid until the rank stops; nothing is left if it is killed. Returns the
    rank's ``distributed_init_method`` (a ``file://`` store outlives the ranks: the executor removes it)."""
    import gc

    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from vllm.distributed.device_communicators.shm_broadcast import ShmRingBuffer

    files = []
    for group in (parallel_state._TP, parallel_state._PP):
        communicator = getattr(group, "device_communicator", None)
        shared = getattr(communicator, "dist_module", None)
        if isinstance(shared, _CPUSHMDistributed):
            files += glob.glob(f"/dev/shm/{glob.escape(shared.group_name)}*")
        queue = getattr(group, "mq_broadcaster", None)
        if queue is not None:
            files += queue_files(queue)
    # The rank's own queues (its response queue among them) are reachable from no handle of vLLM's here.
    made = [buffer for buffer in gc.get_objects() if isinstance(buffer, ShmRingBuffer) and buffer.is_creator]
    files += [disowned(buffer) for buffer in made]
    unlink(files)
    return worker.worker.distributed_init_method


def unlink(files: Iterable[str]) -> None:
    """Remove each of ``files`` that is still there."""
    for path in files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def disowned(buffer: Any) -> str:
    """The ``/dev/shm`` path of a ring buffer made in this process, which collecting it will no longer unlink
    (nor Python's resource tracker at exit): the caller unlinks it."""
    buffer.is_creator = False
    resource_tracker.unregister(buffer.shared_memory._name, "shared_memory")
    return f"/dev/shm/{buffer.shared_memory.name}"


def queue_files(queue: Any) -> list[str]:
    """The files on this machine behind a vLLM message queue, for the caller to unlink: its IPC socket files
    and its ring buffer's shared-memory segment (disowned where this process made it, see `disowned`)."""
    handle = queue.export_handle()
    files = [
        address.removeprefix("ipc://")
        for address in (handle.local_subscribe_addr, handle.local_notify_addr)
        if address and address.startswith("ipc://")
    ]
    if handle.buffer_handle is not None:
        buffer = getattr(queue, "buffer", None)
        if getattr(buffer, "is_creator", False):
            disowned(buffer)
        files.append(f"/dev/shm/{handle.buffer_handle[-1].lstrip('/')}")
    return files


class ReleasingExecutor:
    """An executor over vLLM's message queues (mixed in front of it) that leaves no file behind: once the ranks
    are up, every shared-memory name and queue socket file is unlinked (`release_shared_memory` on each rank,
    `queue_files` here), so that even ranks killed without a word leave none; a ``file://`` rendezvous store
    is removed at shutdown."""

    _stores: tuple[str, ...] = ()

    def _release(self) -> None:
        queues = [getattr(self, "rpc_broadcast_mq", None), *getattr(self, "response_mqs", [])]
        unlink(path for queue in queues if queue is not None for path in queue_files(queue))
        methods = self.collective_rpc(release_shared_memory, timeout=RELEASE_TIMEOUT)  # type: ignore[attr-defined]
        self._stores = tuple({method.removeprefix("file://") for method in methods if method.startswith("file://")})

    def shutdown(self) -> None:
        super().shutdown()  # type: ignore[misc]
        unlink(self._stores)


def rendezvous_beside_sockets() -> str:
    """A ``file://`` rendezvous for the ranks in vLLM's socket directory (``VLLM_RPC_BASE_PATH``), which an
    engine of this library removes as it shuts down, even where its ranks are killed before the store is."""
    from uuid import uuid4

    from vllm import envs

    return f"file://{envs.VLLM_RPC_BASE_PATH}/vllm_dist_{uuid4().hex}"


class CPUMultiprocExecutor(ReleasingExecutor, MultiprocExecutor):
    """vLLM's multiprocessing executor whose ranks' threads are placed by `PlacedThreads`, and whose ranks
    meet at `rendezvous_beside_sockets`."""

    def _init_executor(self) -> None:
        # vLLM's executor builds both from its module's names while it starts the ranks; they are its own
        # again as soon as the ranks are up.
        with (
            mock.patch.object(multiproc_executor, "OMPProcessManager", PlacedThreads),
            mock.patch.object(multiproc_executor, "get_file_store_init_method", rendezvous_beside_sockets),
        ):
            super()._init_executor()
        self._release()


def node_share(placement_group: Any, local_rank: int) -> list[int]:
    """The CPUs of this node a rank of ``placement_group`` runs on: this node's allowed CPUs split among the
    group's bundles placed on it, the ``local_rank``-th share."""
    import ray
    from ray.util.placement_group import placement_group_table

    node = ray.get_runtime_context().get_node_id()
    placed = placement_group_table(placement_group)["bundles_to_node_id"].values()
    ranks = max(1, sum(1 for bundle_node in placed if bundle_node == node))
    return cpu_shares(ranks, os.sched_getaffinity(0))[local_rank % ranks]


class CPURayWorkerProc(RayWorkerProc):
    """vLLM's Ray rank actor on the CPU build: no accelerator ids, threads bound to the rank's share of its node."""

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        import ray

        return ray.get_runtime_context().get_node_id(), []

    def initialize_worker(
        self,
        local_rank: int,
        env_vars: dict[str, str],
        distributed_init_method: str,
        driver_env_vars: dict[str, str] | None = None,
        assigned_physical_gpu_ids: list[int] | None = None,
    ) -> None:
        share = node_share(self._parallel_config.placement_group, local_rank)
        # Threads the rank starts from here on inherit the binding; vLLM's CPU worker forbids
        # torch.set_num_threads once it is up, so the count is set first.
        os.sched_setaffinity(0, share)
        torch.set_num_threads(len(share))
        if self._spans_nodes():
            _shared_memory_per_node()
        super().initialize_worker(
            local_rank, {**env_vars, "OMP_NUM_THREADS": str(len(share))}, distributed_init_method, driver_env_vars
        )

    def _spans_nodes(self) -> bool:
        from ray.util.placement_group import placement_group_table

        nodes = placement_group_table(self._parallel_config.placement_group)["bundles_to_node_id"].values()
        return len(set(nodes)) > 1


def _shared_memory_per_node() -> None:
    """In this rank's process: name vLLM's shared-memory all-reduce groups by node, so that ranks on different
    nodes disagree on the name and vLLM falls back to ``torch.distributed`` (the segments are per machine)."""
    import ray
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    node = ray.get_runtime_context().get_node_id()
    named = _CPUSHMDistributed.make_group_name
    _CPUSHMDistributed.make_group_name = staticmethod(lambda communicator: f"{named(communicator)}-{node}")


@contextlib.contextmanager
def _ray_device_key(key: str) -> Iterator[None]:
    """vLLM's current platform answering ``ray_device_key`` with ``key`` inside the block (this process)."""
    from vllm.platforms import current_platform

    current_platform.ray_device_key = key
    try:
        yield
    finally:
        del current_platform.ray_device_key


class CPURayExecutor(ReleasingExecutor, RayExecutorV2):
    """vLLM's Ray executor (``RayExecutorV2``) on the CPU build: ranks on Ray's ``CPU`` resource."""

    uses_ray = True

    def _init_executor(self) -> None:
        address = (self.vllm_config.additional_config or {}).get(RAY_ADDRESS_KEY)
        from vllm import envs

        # A private cluster's session files go beside the engine's sockets, which the engine's owner removes
        # even where this process is killed before it stops the cluster.
        self._ray: RaySession = join(
            address,
            num_cpus=max(os.cpu_count() or 1, self.parallel_config.world_size),
            runtime_env=self.parallel_config.ray_runtime_env,
            parent=envs.VLLM_RPC_BASE_PATH,
        )
        self._own_placement_group = self.parallel_config.placement_group is None and not _current_placement_group()
        try:
            # vLLM's executor reads the platform's Ray device key and its rank actor class while it starts the
            # ranks: the CPU resource and a rank actor of the CPU build, for that long.
            with _ray_device_key("CPU"), mock.patch.object(ray_executor_v2, "RayWorkerProc", CPURayWorkerProc):
                super()._init_executor()
            self._release()
        except BaseException:
            self._stop_ray()
            raise

    @staticmethod
    def _get_actor_resource_kwargs() -> dict[str, Any]:
        return {"num_gpus": 0}

    def shutdown(self) -> None:
        super().shutdown()
        self._stop_ray()

    def _stop_ray(self) -> None:
        session = getattr(self, "_ray", None)
        if session is None:
            return
        self._ray = None
        group = self.parallel_config.placement_group
        if self._own_placement_group and group is not None:
            import ray

            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(group)
            self.parallel_config.placement_group = None
        session.stop()


def _current_placement_group() -> Any:
    import ray

    return ray.util.get_current_placement_group() if ray.is_initialized() else None
