"""A stand-in accelerator for a server process on vLLM's CPU build: each engine worker that starts asks vLLM's own
GPU check (``vllm.v1.worker.utils.request_memory``) for its share of an 80 GB device, as vLLM's GPU worker does
(``gpu_memory_utilization`` of the device, refused where less than that is free), and what it took stays taken.

Put this directory on a process's ``PYTHONPATH`` (Python imports ``sitecustomize`` as it starts) with
``NNTERP_TEST_DEVICE_LEDGER`` naming a file: each worker that starts appends its share to it, as a JSON line. A
second engine in the process then finds only what the first left free, and vLLM refuses it as on a real device.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
from types import SimpleNamespace

#: The stand-in device's memory (an 80 GB accelerator).
TOTAL = 80 * 10**9
LEDGER = "NNTERP_TEST_DEVICE_LEDGER"


def taken(path: str) -> int:
    """Bytes the workers that started in this ledger took."""
    if not os.path.exists(path):
        return 0
    with open(path) as ledger:
        return sum(json.loads(line)["requested"] for line in ledger if line.strip())


def request(path: str, cache_config: object) -> int:
    """vLLM's check of a starting worker against the stand-in device, and its share noted in the ledger."""
    from vllm.v1.worker.utils import request_memory

    snapshot = SimpleNamespace(total_memory=TOTAL, free_memory=TOTAL - taken(path), device_="cuda:0 (stand-in)")
    requested = request_memory(snapshot, cache_config)
    with open(path, "a") as ledger:
        ledger.write(json.dumps({"requested": requested, "pid": os.getpid()}) + "\n")
    return requested


def patch(module: object) -> None:
    worker = module.CPUWorker
    init_device = worker.init_device

    def init_device_on_the_device(self: object) -> None:
        init_device(self)
        request(os.environ[LEDGER], self.cache_config)

    worker.init_device = init_device_on_the_device


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches vLLM's CPU worker as it is imported."""

    name = "vllm.v1.worker.cpu_worker"

    def find_spec(self, name: str, path: object, target: object = None) -> object:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module: object) -> None:
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(LEDGER):
    sys.meta_path.insert(0, PatchOnImport())
