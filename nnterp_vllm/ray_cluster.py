"""Ray for the project's engines and fan-outs (the Ray executor, ``harvest --workers``, ``serve --replicas``):
join the cluster asked for, or start a private one, and leave nothing behind.

A cluster is joined at ``address`` (or ``RAY_ADDRESS``). Without one, a private cluster starts on this
machine: on loopback (``127.0.0.1``), with token authentication off so it writes no token under the home
directory (``RAY_AUTH_MODE=disabled`` while Ray starts, unless the caller chose a mode), its session files
in a directory of its own, short enough for Ray's socket paths. A janitor process, in a session of its own,
waits on a pipe that only the driver holds: when the driver stops the cluster, or dies (even by SIGKILL,
after which Ray's dashboard and runtime-env agents live on), the pipe closes and the janitor stops every
process still holding a file in that directory and removes it. Where Ray is already initialized in this
process, that session is used as it is and never stopped here.

Run as ``python -m nnterp_vllm.ray_cluster DIRECTORY DRIVER_PID``, this module is that janitor.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Seconds a process holding the cluster's files gets to end after SIGTERM, before SIGKILL.
STOP_SECONDS = 10
#: Ray's environment variable naming a cluster to join.
ADDRESS_VARIABLE = "RAY_ADDRESS"
#: The longest session directory Ray's socket paths fit under (``AF_UNIX`` allows 107 bytes; Ray adds about 62).
SESSION_DIRECTORY_ROOM = 44


@dataclass
class RaySession:
    """Ray as this process joined or started it: what `stop` undoes."""

    #: Whether ``ray.init`` was called here (so `stop` calls ``ray.shutdown``).
    initialized: bool
    #: The session directory of a private cluster started here, else ``None``.
    directory: str | None = None
    #: The janitor of that directory (see the module).
    janitor: subprocess.Popen | None = None

    def stop(self) -> None:
        """Leave the cluster joined, or stop the private one and let its janitor clean up after it; idempotent."""
        if self.initialized:
            import ray

            ray.shutdown()
            self.initialized = False
        if self.janitor is not None:
            self.janitor.stdin.close()
            self.janitor.wait()
            self.janitor = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def join(
    address: str | None = None, *, num_cpus: int | None = None, parent: str | None = None, **options: Any
) -> RaySession:
    """Ray initialized in this process: the session already there, the cluster at ``address`` (or
    ``RAY_ADDRESS``), or a private cluster with ``num_cpus`` logical CPUs (the machine's by default) whose
    session directory is made in ``parent`` (the system's temporary directory by default, or where a directory
    in ``parent`` would make Ray's socket paths too long). ``options`` go to ``ray.init`` (no dashboard unless
    they say so)."""
    import ray

    if ray.is_initialized():
        return RaySession(initialized=False)
    options.setdefault("include_dashboard", False)
    address = address or os.environ.get(ADDRESS_VARIABLE) or None
    if address is not None:
        ray.init(address=address, **options)
        return RaySession(initialized=True)
    if parent is not None and len(os.path.join(parent, "ray-xxxxxxxx")) > SESSION_DIRECTORY_ROOM:
        parent = None
    directory = tempfile.mkdtemp(prefix="ray-" if parent else "nnterp-ray-", dir=parent)
    session = RaySession(initialized=False, directory=directory, janitor=_janitor(directory))
    try:
        with _token_auth_off():
            ray.init(num_cpus=num_cpus, _temp_dir=directory, _node_ip_address="127.0.0.1", **options)
    except BaseException:
        session.stop()
        raise
    session.initialized = True
    return session


@contextlib.contextmanager
def connected(address: str | None, num_cpus: int | None = None, **options: Any) -> Iterator[None]:
    """`join` for the block: the session is stopped on the way out."""
    session = join(address, num_cpus=num_cpus, **options)
    try:
        yield
    finally:
        session.stop()


def _janitor(directory: str) -> subprocess.Popen:
    """The janitor of ``directory`` (see the module), watching this process from before the cluster starts."""
    return subprocess.Popen(
        [sys.executable, "-m", __name__, directory, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@contextlib.contextmanager
def _token_auth_off() -> Iterator[None]:
    """``RAY_AUTH_MODE=disabled`` while a private cluster starts, unless the caller chose a mode."""
    if "RAY_AUTH_MODE" in os.environ:
        yield
        return
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        yield
    finally:
        os.environ.pop("RAY_AUTH_MODE", None)


def sweep(directory: Path, driver: int) -> None:
    """Stop every process but the ``driver`` holding a file under ``directory`` (SIGTERM, then SIGKILL), then
    remove it."""
    import psutil

    holders = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.pid not in (os.getpid(), driver) and any(
                _under(f.path, directory) for f in process.open_files()
            ):
                holders.append(process)
    for process in holders:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(holders, timeout=STOP_SECONDS)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=STOP_SECONDS)
    shutil.rmtree(directory, ignore_errors=True)


def _under(path: str, directory: Path) -> bool:
    return Path(path).is_relative_to(directory)


if __name__ == "__main__":
    sys.stdin.buffer.read()  # returns when the driver closes the pipe or dies
    sweep(Path(sys.argv[1]), int(sys.argv[2]))
