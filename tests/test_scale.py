"""Sharded loads and several machines, on real processes: tensor parallel on both engines, vLLM's Ray executor on
the CPU build, Ray clusters of two nodes on this machine, and nothing left behind.

Every value is checked against the single-process run of the same tiny llama (4 heads, 2 key/value heads: it
splits 2 ways) or transformers' own outputs. The refusals and the CPU split run in the default suite; the runs
that start several processes or Ray clusters are marked ``scale`` (``pytest -m scale tests/test_scale.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
import scale_runs
import tiny
import torch
from safetensors.torch import load_file
from test_serve import Server, free_port
from vllm import SamplingParams

from nnterp_vllm import StandardizedTransformer, StandardizedVLLM, SteeredVLLM, Steering, harvest
from nnterp_vllm.checkpoints import smollm2
from nnterp_vllm.cli import main
from nnterp_vllm.engines.cpu_executors import cpu_shares
from nnterp_vllm.engines.engine_defaults import engine_kwargs

ROOT = Path(__file__).resolve().parent.parent
RUNS = str(Path(scale_runs.__file__))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
RAY = str(Path(sys.executable).with_name("ray"))
#: fp32; a sharded matmul sums its partial products in another order than one process does.
TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}
#: vLLM's kernels against transformers' (as in tests/test_vllm.py).
ACROSS_ENGINES = {"atol": 1e-4, "rtol": 1e-4}


def close(got: torch.Tensor, want: torch.Tensor, **tolerance) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    torch.testing.assert_close(got.float(), want.float(), **(tolerance or TOLERANCE))


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child run on its own: vLLM's socket directory and in-process engine
    settings of the test session left out (an engine of the library makes its own)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_RPC_BASE_PATH", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {**env, **extra}


# -- default suite: the split and the refusals ----------------------------------------------------------------


def test_cpu_shares_split_the_allowed_cpus_among_ranks():
    assert cpu_shares(2, {0, 1}) == [[0], [1]]
    assert cpu_shares(2, {3, 0, 1, 2, 4}) == [[0, 1, 2], [3, 4]]
    assert cpu_shares(4, {0, 1}) == [[0], [1], [0], [1]]
    assert cpu_shares(1, os.sched_getaffinity(0)) == [sorted(os.sched_getaffinity(0))]


def test_worker_processes_get_the_placing_executor_and_ray_the_cpu_ray_executor(monkeypatch):
    from nnterp_vllm.engines.cpu_executors import RAY_ADDRESS_KEY, CPUMultiprocExecutor, CPURayExecutor

    assert engine_kwargs(tensor_parallel_size=2)["distributed_executor_backend"] is CPUMultiprocExecutor
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one rank in this process: vLLM's own
    assert "distributed_executor_backend" not in engine_kwargs(tensor_parallel_size=1)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # one rank in a worker process
    assert engine_kwargs(tensor_parallel_size=1)["distributed_executor_backend"] is CPUMultiprocExecutor
    ray = engine_kwargs(tensor_parallel_size=2, distributed_executor_backend="ray", ray_address="10.0.0.1:6379")
    assert ray["distributed_executor_backend"] is CPURayExecutor
    assert ray["additional_config"][RAY_ADDRESS_KEY] == "10.0.0.1:6379" and "ray_address" not in ray


def test_ray_address_without_the_ray_executor_is_refused():
    with pytest.raises(ValueError, match="needs distributed_executor_backend='ray'"):
        engine_kwargs(tensor_parallel_size=2, ray_address="10.0.0.1:6379")


def test_a_model_whose_heads_do_not_split_is_refused_on_both_engines(monkeypatch):
    """SmolLM2 has 9 heads and 3 key/value heads: refused on 2 ranks before anything loads, naming the splits
    each engine can make (vLLM copies key/value heads onto ranks when they are fewer)."""
    heads = "cannot split this model's 9 attention heads and 3 key/value heads evenly: it splits"
    with pytest.raises(ValueError, match=f"{heads} 1, 3 or 9 ways"):
        StandardizedVLLM(smollm2(), tensor_parallel_size=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=f"{heads} 1 or 3 ways"):
        StandardizedTransformer(smollm2(), tp_size=2)


def test_transformers_tensor_parallel_outside_a_launcher_is_refused():
    path = tiny.checkpoint("llama")
    with pytest.raises(ValueError, match="launch with `torchrun --nproc-per-node 2"):
        StandardizedTransformer(path, tp_size=2)
    from transformers import DistributedConfig

    with pytest.raises(ValueError, match="either distributed_config= or tp_plan="):
        StandardizedTransformer(path, tp_plan="auto", distributed_config=DistributedConfig(tp_size=2))


def test_harvest_refuses_transformers_tensor_parallel_on_ray_workers(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="runs its ranks under torchrun, not on Ray workers"):
        harvest(
            tiny.checkpoint("llama"),
            ["a b"],
            "layers.0.layer_output",
            tmp_path / "a",
            workers=2,
            model_kwargs={"tp_size": 2},
            progress=False,
        )
    assert not (tmp_path / "a").exists()


def test_the_command_line_refuses_a_bad_tensor_parallel_size(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("a b\n")
    common = [str(tiny.checkpoint("llama")), "--corpus", str(corpus), "--values", "layers.0.layer_output"]
    assert main(["harvest", *common, "--out", str(tmp_path / "a"), "--tensor-parallel-size", "0"]) == 2
    assert "--tensor-parallel-size must be >= 1, got 0" in capsys.readouterr().err
    assert main(["harvest", *common, "--out", str(tmp_path / "b"), "--tensor-parallel-size", "2"]) == 2
    assert "launch with `torchrun --nproc-per-node 2 ...`" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# -- vLLM: the Ray executor on the CPU build ------------------------------------------------------------------


def timed(build):
    start = time.monotonic()
    built = build()
    return built, time.monotonic() - start


@pytest.mark.scale
def test_ray_executor_serves_whole_values_and_steers_as_one_rank():
    """StandardizedVLLM and SteeredVLLM on two ranks of vLLM's Ray executor (a private local cluster, started and
    stopped by the engine): values equal transformers', steered tokens equal one rank's."""
    path = tiny.checkpoint("llama")
    reference = StandardizedTransformer(path)
    names = ("attention_queries", "attention_keys", "attention_premix", "attention_head_outputs")

    def values(model):
        saved = []
        with model.trace(scale_runs.PROMPT):
            for name in names:
                saved.append(getattr(model.layers[1].self_attn, name).save())
            saved.append(model.layers[2].layer_output.save())
            saved.append(model.logits.save())
        return saved

    want = values(reference)
    model, load = timed(
        lambda: StandardizedVLLM(
            path, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray", dispatch=True
        )
    )
    try:
        got, trace = timed(lambda: values(model))
        for got_value, want_value in zip(got, want):
            close(got_value, want_value, **ACROSS_ENGINES)
        # Each rank runs on its own share of this machine's CPUs, with as many torch threads.
        placed = model.vllm_entrypoint.collective_rpc(
            lambda worker: (sorted(os.sched_getaffinity(0)), torch.get_num_threads())
        )
        assert placed == [(share, len(share)) for share in cpu_shares(2, os.sched_getaffinity(0))]
    finally:
        model.shutdown()
    print(f"StandardizedVLLM TP=2 Ray executor: load {load:.1f} s, first trace {trace:.2f} s")

    steering = [Steering(1, torch.ones(128), factor=2.0), None]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = []
    for kwargs in ({}, {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}):
        llm = SteeredVLLM(path, dtype="float32", max_model_len=256, **kwargs)
        try:
            outputs = llm.generate(["Hello world", "The tower"], params, steering)
        finally:
            llm.shutdown()
        tokens.append([list(output.outputs[0].token_ids) for output in outputs])
    assert tokens[0] == tokens[1]
    import ray

    assert not ray.is_initialized()  # the private cluster stopped with its engine


# -- transformers: torchrun, two ranks ------------------------------------------------------------------------


def torchrun(tmp_path: Path, command: str) -> None:
    run = subprocess.run(
        # torchrun's logs in the test's directory (it makes a directory in /tmp otherwise, and leaves it).
        [
            TORCHRUN,
            "--standalone",
            "--nproc-per-node",
            "2",
            "--log-dir",
            str(tmp_path / "logs"),
            RUNS,
            command,
            str(tmp_path),
        ],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]


@pytest.mark.scale
def test_torchrun_two_ranks_serve_every_value_whole_and_equal_to_one_process(tmp_path):
    """Every block value (the attention interior gathered across the ranks), the logits, writes (an in-place edit
    of the queries, values assigned, head outputs assigned), steer, skip_layers and the logit lens: on each of two
    ranks, equal to the same reads in one process."""
    torchrun(tmp_path, "values")
    want = scale_runs.read_everything(StandardizedTransformer(tiny.checkpoint("llama")))
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.keys() == want.keys()
        for name in want:
            close(got[name], want[name])


@pytest.mark.scale
def test_torchrun_harvest_is_written_by_rank_zero_and_equals_one_process(tmp_path):
    torchrun(tmp_path, "harvest")
    one = scale_runs.harvest_into(tmp_path / "one")
    sharded = json.loads((tmp_path / "rank0.json").read_text())
    assert (
        sharded == json.loads((tmp_path / "rank1.json").read_text()) == {"tokens": len(one), "shards": len(one.shards)}
    )
    assert len(one.shards) > 2
    assert sorted(path.name for path in (tmp_path / "acts").iterdir()) == sorted(
        path.name for path in (tmp_path / "one").iterdir()
    )
    for shard in one.shards:
        got, want = load_file(tmp_path / "acts" / shard), load_file(tmp_path / "one" / shard)
        assert got.keys() == want.keys()
        for name in want:
            close(got[name], want[name])


# -- Ray: two nodes on this machine ---------------------------------------------------------------------------


def ray_node(directory: Path, *arguments: str) -> None:
    run = subprocess.run(
        [RAY, "start", "--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats", *arguments],
        # RAY_TMPDIR: a worker node takes no --temp-dir, and would write its session under /tmp/ray otherwise.
        env=clean_env(RAY_AUTH_MODE="disabled", VLLM_ENABLE_V1_MULTIPROCESSING="0", RAY_TMPDIR=str(directory)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def stop_processes_of(directories: list[Path]) -> None:
    """Stop, by PID, the processes whose command line names one of ``directories`` and their descendants."""
    found = set()
    for process in psutil.process_iter(["cmdline"]):
        if process.pid != os.getpid() and any(
            str(d) in arg for d in directories for arg in process.info["cmdline"] or []
        ):
            found.add(process)
            try:
                found.update(process.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
    for process in found:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(found), timeout=15)
    for process in alive:
        process.kill()


@pytest.fixture(scope="module")
def two_nodes():
    """A Ray cluster of two nodes (one CPU each) on this machine, each started with its own temporary directory;
    its address. Stopped by PID."""
    directories = [Path(tempfile.mkdtemp(prefix="nnterp-node-")) for _ in range(2)]
    port = free_port()
    try:
        ray_node(
            directories[0],
            "--head",
            "--port",
            str(port),
            "--temp-dir",
            str(directories[0]),
            "--include-dashboard",
            "false",
        )
        ray_node(directories[1], "--address", f"127.0.0.1:{port}", "--temp-dir", str(directories[1]))
        yield f"127.0.0.1:{port}"
    finally:
        stop_processes_of(directories)
        for directory in directories:
            shutil.rmtree(directory, ignore_errors=True)


def actors_nodes(address: str, class_name: str) -> list[str]:
    """The nodes the cluster's actors of ``class_name`` ran on (dead ones included), from its control store."""
    import ray

    ray.init(address=address, log_to_driver=False)
    try:
        table = ray._private.state.actors()
    finally:
        ray.shutdown()
    return [actor["Address"]["NodeID"] for actor in table.values() if actor["ActorClassName"] == class_name]


@pytest.mark.scale
def test_two_nodes_run_a_tensor_parallel_engine_across_them_and_a_spread_harvest(two_nodes, tmp_path):
    """A TP=2 engine on vLLM's Ray executor whose two ranks sit on the two nodes (one CPU each), its values
    equal to transformers'; then ``harvest --workers 2 --ray-address``: one replica per node, the shards
    byte-identical to a single worker's."""
    path = tiny.checkpoint("llama")
    reference = StandardizedTransformer(path)
    with reference.trace(scale_runs.PROMPT):
        want = [reference.layers[1].self_attn.attention_queries.save(), reference.logits.save()]
    model = StandardizedVLLM(
        path,
        dtype="float32",
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        ray_address=two_nodes,
        dispatch=True,
    )
    try:
        with model.trace(scale_runs.PROMPT):
            got = [model.layers[1].self_attn.attention_queries.save(), model.logits.save()]
    finally:
        model.shutdown()
    for got_value, want_value in zip(got, want):
        close(got_value, want_value, **ACROSS_ENGINES)
    assert len(set(actors_nodes(two_nodes, "CPURayWorkerProc"))) == 2

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in scale_runs.DOCUMENTS))
    common = [
        sys.executable,
        "-m",
        "nnterp_vllm.cli",
        "harvest",
        str(path),
        "--corpus",
        str(corpus),
        "--engine",
        "vllm",
        "--values",
        "layers.*.layer_output",
        "--model-dtype",
        "float32",
        "--shard-mb",
        "0.02",
        "--quiet",
    ]
    spread = ["--workers", "2", "--ray-address", two_nodes, "--shared-filesystem"]  # both nodes see this /tmp
    for out, more in (("spread", spread), ("one", [])):
        run = subprocess.run(
            [*common, "--out", str(tmp_path / out), *more], env=clean_env(), capture_output=True, text=True, timeout=900
        )
        assert run.returncode == 0, run.stderr[-5000:]
    assert len(set(actors_nodes(two_nodes, "ShardWorker"))) == 2
    shards = sorted(p.name for p in (tmp_path / "one").glob("shard-*"))
    assert len(shards) > 2 and shards == sorted(p.name for p in (tmp_path / "spread").glob("shard-*"))
    for name in shards:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "spread" / name).read_bytes()


# -- serving on two ranks -------------------------------------------------------------------------------------


@pytest.mark.scale
def test_serve_on_two_ray_ranks_answers_as_one_rank_and_leaves_nothing(tmp_path):
    path = tiny.checkpoint("llama")
    engine = {"dtype": "float32", "max_model_len": 256}
    vector = torch.ones(128)
    llm = SteeredVLLM(path, **engine)
    try:
        [output] = llm.generate(
            ["Hello world"],
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
            Steering(1, vector, factor=2.0),
        )
    finally:
        llm.shutdown()
    arguments = [str(path), "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256"]
    arguments += ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]
    server = Server(arguments, tmp_path / "server.log", env=clean_env())
    try:
        server.wait_ready()
        body = {
            "model": "tiny",
            "prompt": "Hello world",
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "steering": [{"layers": 1, "vector": vector.tolist(), "factor": 2.0}],
        }
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        assert answer["choices"][0]["token_ids"] == list(output.outputs[0].token_ids)
    finally:
        assert server.stop() == 0
    server.assert_left_nothing()


# -- nothing left behind --------------------------------------------------------------------------------------


def isolated(command: list[str]) -> list[str]:
    """``command`` in a mount namespace of its own with fresh /dev/shm and /tmp, so that only its own files are
    counted (other processes on the machine make theirs meanwhile); as it is where namespaces are not allowed."""
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        return command
    mounts = 'mount -t tmpfs tmpfs /dev/shm && mount -t tmpfs tmpfs /tmp && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", mounts, "sh", *command]


@pytest.mark.scale
def test_tensor_parallel_ray_executor_and_harvest_replicas_leave_no_file_behind():
    """A TP=2 engine (multiprocessing executor), a TP=2 engine on the Ray executor and a two-replica vLLM harvest
    on Ray, each as a user runs them (vLLM's multiprocess engine): /dev/shm and /tmp hold after each run what they
    held before it."""
    run = subprocess.run(
        isolated([sys.executable, RUNS, "leftovers"]), env=clean_env(), capture_output=True, text=True, timeout=1800
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    [line] = [line for line in run.stdout.splitlines() if line.startswith("LEFTOVERS ")]
    assert json.loads(line.removeprefix("LEFTOVERS ")) == {"tp2-mp": [], "tp2-ray": [], "workers2-vllm": []}
