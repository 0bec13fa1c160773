"""A damaged vLLM compile cache never blocks an engine start (`engines.compile_cache`).

The fast tests build cache trees of real shared objects (one of Python's own extension modules), whole,
emptied and cut short. The slow test (``pytest -m slow tests/test_compile_cache.py``, about 6 minutes
here) compiles a real steered engine into a private ``VLLM_CACHE_ROOT``, empties one of the shared
objects it wrote (what an engine killed while compiling leaves), and starts the engine again, then the
server: each start removes the entry, logs one line and compiles again, and answers as before.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import tiny

from nnterp_vllm.engines.compile_cache import remove_damaged_entries, start_recompiling_once

SHARED_OBJECT = Path(importlib.util.find_spec("_uuid").origin)
LOGGER = "nnterp_vllm.engines.compile_cache"


def artifact(root: Path, relative: str, content: bytes) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


@pytest.fixture
def cache(tmp_path):
    """A compile cache: a healthy entry of each layout, and entries with an emptied, a cut-short and a
    being-written shared object."""
    root = tmp_path / "torch_compile_cache"
    whole = SHARED_OBJECT.read_bytes()
    entries = {
        "healthy": "torch_aot_compile/aaa",
        "healthy, vLLM's other layout": "bbb",
        "emptied": "torch_aot_compile/ccc",
        "cut short": "ddd",
        "being written": "torch_aot_compile/eee",
    }
    for name in ("healthy", "healthy, vLLM's other layout"):
        artifact(root, f"{entries[name]}/inductor_cache/ab/cab.main.so", whole)
        artifact(root, f"{entries[name]}/inductor_cache/locks/cab.lock", b"")  # locks are empty
        artifact(root, f"{entries[name]}/rank_0_0/model", b"compiled")
    artifact(root, "torch_aot_compile/ccc/inductor_cache/ep/cep.main.so", b"")
    artifact(root, "ddd/rank_0_0/backbone/inductor_cache/xy/cxy.main.so", whole[: len(whole) // 2])
    artifact(root, "torch_aot_compile/eee/inductor_cache/zz/czz.main.so", whole[:100])
    lock = artifact(root, "torch_aot_compile/eee/inductor_cache/locks/czz.lock", b"")
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as torch's compiler holds it while it writes czz.main.so
        yield root, {name: root / relative for name, relative in entries.items()}


def test_entries_with_a_damaged_artifact_are_removed_with_one_log_line_each(cache, caplog):
    root, entries = cache
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        removed = remove_damaged_entries(root)
    assert sorted(removed) == sorted([entries["emptied"], entries["cut short"]])
    assert [name for name, entry in entries.items() if entry.exists()] == [
        "healthy",
        "healthy, vLLM's other layout",
        "being written",
    ]
    lines = sorted(record.getMessage() for record in caplog.records)
    assert len(lines) == 2
    assert (
        f"entry {entries['cut short']} (damaged: rank_0_0/backbone/inductor_cache/xy/cxy.main.so: cut short" in lines[0]
    )
    assert f"entry {entries['emptied']} (damaged: inductor_cache/ep/cep.main.so: empty); compiling it again" in lines[1]


def test_a_failed_start_is_retried_once_only_where_an_entry_was_damaged(cache):
    root, entries = cache
    calls = []

    def start():
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("Engine core initialization failed")
        return "started"

    assert start_recompiling_once(start, root) == "started" and len(calls) == 2
    assert not entries["emptied"].exists()

    def failing():
        calls.append(len(calls))
        raise RuntimeError("another cause")

    with pytest.raises(RuntimeError, match="another cause"):  # nothing damaged is left: raised as it is
        start_recompiling_once(failing, root)
    assert len(calls) == 3 and entries["healthy"].exists()


ENGINE_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import tiny
from vllm import SamplingParams
from nnterp_vllm import SteeredVLLM, Steering
llm = SteeredVLLM(tiny.checkpoint("llama"), dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 * 2**20)
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
steering = [None, Steering(1, [0.5] * 128, factor=4.0)]
outputs = llm.generate(["The quick brown fox", "The quick brown fox"], params, steering, use_tqdm=False)
print(json.dumps([list(output.outputs[0].token_ids) for output in outputs]))
llm.shutdown()
"""


def start_engine(env: dict[str, str]) -> tuple[list[list[int]], str]:
    """SteeredVLLM built in a process of its own, in-process engine: the tokens it generated and its log."""
    script = ENGINE_SCRIPT.format(tests=str(Path(__file__).parent))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def empty_one_shared_object(root: Path, among: set[Path] | None = None) -> Path:
    damaged = sorted(among if among is not None else root.rglob("*.main.so"))[0]
    damaged.write_bytes(b"")
    return damaged


def serve_answers(arguments: list[str], tmp_path: Path, log: str) -> list[int]:
    """The tokens ``nnterp-vllm serve`` (compile cache in ``tmp_path``) answers the first prompt with; stopped."""
    from test_serve import Server

    server = Server(arguments, tmp_path / log, env={"VLLM_CACHE_ROOT": str(tmp_path / "vllm")})
    try:
        server.wait_ready()
        body = {"model": str(tiny.checkpoint("llama")), "prompt": "The quick brown fox", "max_tokens": 6}
        body |= {"temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
    finally:
        assert server.stop() == 0
        server.assert_left_nothing()


#: A child that starts a steered engine on a tiny llama (in its own process, with vLLM's AOT setting unset) and prints
#: what its start compiled: vLLM's whole-model compiles and inductor's compiled-graph cache hits and misses.
START_AND_COUNT = """
import json, os, sys
sys.path.insert(0, {tests!r})
import tiny
from torch._dynamo.utils import counters
from vllm.compilation.counter import compilation_counter
from nnterp_vllm import SteeredVLLM
llm = SteeredVLLM(tiny.checkpoint("llama"), dtype="float32", max_model_len=256)
llm.shutdown()
inductor = counters["inductor"]
print(json.dumps({{"aot_compiles": compilation_counter.num_aot_compiles, "setting": os.environ["VLLM_USE_AOT_COMPILE"],
                  "hits": inductor["fxgraph_cache_hit"], "misses": inductor["fxgraph_cache_miss"]}}))
"""


@pytest.mark.slow
def test_a_second_start_of_an_engine_compiles_nothing_again():
    """vLLM's CPU build cannot load back the ahead-of-time artifact it saves (and would compile the whole model on
    every start): the library starts its engines without it, and a second start loads every graph it compiles."""
    code = START_AND_COUNT.format(tests=str(Path(__file__).parent))
    environment = {name: value for name, value in os.environ.items() if name != "VLLM_USE_AOT_COMPILE"}
    environment["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    starts = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Compiling model again due to a load failure" not in done.stderr
        starts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert starts[1] == {"aot_compiles": 0, "setting": "0", "hits": starts[1]["hits"], "misses": 0}
    assert starts[1]["hits"] > 0


@pytest.mark.slow
def test_a_real_cache_with_an_emptied_shared_object_is_compiled_again(tmp_path):
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    expected, log = start_engine(env)  # compiles into the private cache
    assert "compile-cache entry" not in log
    root = tmp_path / "vllm" / "torch_compile_cache"
    damaged = empty_one_shared_object(root)
    tokens, log = start_engine(env)
    assert tokens == expected
    (line,) = [line for line in log.splitlines() if "compile-cache entry" in line]
    assert f"(damaged: {damaged.relative_to(damaged.parents[2])}: empty); compiling it again" in line
    assert damaged.stat().st_size > 0  # compiled again
    # The server, whose engine runs in a process of its own (its settings key an entry of their own): the
    # same, through its log.
    arguments = [str(tiny.checkpoint("llama")), "--dtype", "float32", "--max-model-len", "128"]
    arguments += ["--kv-cache-memory-bytes", str(8 * 2**20)]
    before = set(root.rglob("*.main.so"))
    assert serve_answers(arguments, tmp_path, "server.log") == expected[0]  # compiles the server's entry
    damaged = empty_one_shared_object(root, set(root.rglob("*.main.so")) - before)
    assert serve_answers(arguments, tmp_path, "server-again.log") == expected[0]
    (line,) = [
        line for line in (tmp_path / "server-again.log").read_text().splitlines() if "compile-cache entry" in line
    ]
    assert "empty); compiling it again" in line and damaged.stat().st_size > 0
    shutil.rmtree(tmp_path / "vllm")
