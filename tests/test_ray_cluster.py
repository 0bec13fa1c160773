"""Ray clusters the project starts (``harvest --workers``, ``serve --replicas``) leave nothing behind.

Each run gets its own temporary directory (``TMPDIR``) and home directory (``HOME``), so what it left, or
did not, is its own: no authentication token under the home directory, no temporary directory, and no
process (Ray's raylet, GCS, workers, dashboard and runtime-env agents) after the driver ends, normally
or killed with SIGKILL while its workers load.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import tiny

NNTERP_VLLM = str(Path(sys.executable).with_name("nnterp-vllm"))


def holders(directory: Path) -> list[psutil.Process]:
    """Live processes holding a file under ``directory``."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() != psutil.STATUS_ZOMBIE and any(
                Path(f.path).is_relative_to(directory) for f in process.open_files()
            ):
                found.append(process)
        except psutil.Error:
            pass
    return found


@pytest.fixture
def tmp_path():
    """A directory of the test's right under /tmp: Ray's socket paths under its ``tmp`` must stay within 107 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def run(tmp_path):
    """A harvest on 2 Ray workers, as a command in its own process with its own TMPDIR and HOME."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Document {i} is about the sea.\n" for i in range(8)))
    (tmp_path / "t").mkdir()
    (tmp_path / "home").mkdir()
    command = [NNTERP_VLLM, "harvest", str(tiny.checkpoint("llama")), "--corpus", str(corpus), "--quiet"]
    command += ["--values", "layers.1.layer_output", "--out", str(tmp_path / "acts"), "--workers", "2"]
    env = {**os.environ, "TMPDIR": str(tmp_path / "t"), "HOME": str(tmp_path / "home")}
    env.pop("RAY_AUTH_MODE", None)
    return lambda: subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def left_behind(tmp_path: Path, seconds: float = 60) -> tuple[list, list, list]:
    """What the run left after up to ``seconds``: its temporary entries, processes holding them, its home's files."""
    deadline = time.monotonic() + seconds
    while True:
        entries = list((tmp_path / "t").glob("nnterp-ray-*"))
        processes = holders(tmp_path / "t")
        home = list((tmp_path / "home").rglob("*"))
        if not (entries or processes or home) or time.monotonic() > deadline:
            return entries, [p.name() for p in processes], home
        time.sleep(0.5)


def test_a_harvest_on_ray_leaves_nothing_after_a_normal_end(run, tmp_path):
    process = run()
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-3000:]
    assert (tmp_path / "acts" / "manifest.json").exists()
    assert left_behind(tmp_path, seconds=30) == ([], [], [])


def test_a_harvest_on_ray_leaves_nothing_after_its_driver_is_killed(run, tmp_path):
    process = run()
    deadline = time.monotonic() + 300
    while not any("ShardWorker" in p.name() for p in holders(tmp_path / "t")):  # the workers are loading
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()[-3000:]
        time.sleep(0.5)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert left_behind(tmp_path) == ([], [], [])
