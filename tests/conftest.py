import glob
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Before anything imports vLLM: engines run in this process (one process, 3-5 s to build), and
# the IPC socket files vLLM leaves behind go to a directory the session removes.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
RPC_DIRECTORY = tempfile.mkdtemp(prefix="nnterp-vllm-rpc-")
os.environ["VLLM_RPC_BASE_PATH"] = RPC_DIRECTORY
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session", autouse=True)
def clean_up_engine_files():
    """Remove what vLLM engines started by the tests leave in /tmp and /dev/shm."""
    shared_before = set(glob.glob("/dev/shm/vllm_*"))
    yield
    shutil.rmtree(RPC_DIRECTORY, ignore_errors=True)
    for leftover in set(glob.glob("/dev/shm/vllm_*")) - shared_before:
        os.remove(leftover)
