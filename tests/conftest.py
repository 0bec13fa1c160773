import gc
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
# The plain vLLM engines tests build as references start as the library's do (`reuse_compiled_models`).
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
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


@pytest.fixture(scope="session", autouse=True)
def vllm_model_infos_cached():
    """vLLM's model-info cache holds every architecture the tests load before the first engine starts
    (`vllm_model_infos`): one interpreter inspects them all, not one per architecture."""
    import vllm_model_infos

    vllm_model_infos.ensure_filled()


#: The garbage collector's freeze, which `frozen_heap` keeps to itself for the session.
FREEZE, UNFREEZE = gc.freeze, gc.unfreeze


@pytest.fixture(scope="session", autouse=True)
def frozen_heap():
    """The session freezes the heap, not vLLM: its in-process engine freezes the whole heap as it starts and
    unfreezes it as it shuts down, which would undo `long_lived_objects_frozen`."""
    gc.freeze = gc.unfreeze = lambda: None
    yield
    gc.freeze, gc.unfreeze = FREEZE, UNFREEZE
    UNFREEZE()


@pytest.fixture(scope="module", autouse=True)
def long_lived_objects_frozen(frozen_heap):
    """Keep what earlier modules imported and the session's fixtures out of the garbage collector's full passes.

    vLLM's in-process engine runs about nine full collections per build and shutdown, half a second each
    over torch's, transformers' and vLLM's objects; with what is alive as a module starts frozen (after one
    collection), they scan only what was made since, and still collect what each engine leaves.
    """
    gc.collect()
    FREEZE()


@pytest.fixture(scope="module")
def llama_path():
    """The tiny llama checkpoint (`tiny.checkpoint`), built once and cached."""
    import tiny

    return tiny.checkpoint("llama")
