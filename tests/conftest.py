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
# Engines run in this process (one process, 3-5 s to build instead of 12-30 s).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session", autouse=True)
def clean_up_engine_files():
    """Keep the IPC socket files vLLM leaves behind in a directory of the session's, and remove them
    and the shared-memory files the tests' engines made when the session ends."""
    directory = tempfile.mkdtemp(prefix="nnterp-vllm-rpc-")
    os.environ["VLLM_RPC_BASE_PATH"] = directory
    shared_before = set(glob.glob("/dev/shm/vllm_*"))
    yield
    shutil.rmtree(directory, ignore_errors=True)
    for leftover in set(glob.glob("/dev/shm/vllm_*")) - shared_before:
        os.remove(leftover)
