"""Harvesting: values equal direct traces, shards and manifest, resuming after SIGKILL, bounded memory, errors."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import tiny
import torch

from nnterp_vllm import StandardizedTransformer, load_harvest
from nnterp_vllm.checksums import recorded_checksum
from nnterp_vllm.harvest import HarvestError, harvest
from nnterp_vllm.harvest import files as files_module
from nnterp_vllm.harvest import reader as reader_module
from nnterp_vllm.harvest.corpus import CorpusError

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards hex bold jumping zebras".split()


def documents(count: int, seed: int = 0) -> list[str]:
    """``count`` documents of 3..40 words, one in nine empty, deterministic."""
    generator = torch.Generator().manual_seed(seed)
    docs = []
    for i in range(count):
        length = 0 if i % 9 == 4 else int(torch.randint(3, 40, (1,), generator=generator))
        picks = torch.randint(0, len(WORDS), (length,), generator=generator).tolist()
        docs.append(" ".join(WORDS[j] for j in picks))
    return docs


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    return path


@pytest.fixture(scope="module")
def llama(llama_path):
    return StandardizedTransformer(llama_path)


def shard_digests(out: Path) -> dict[str, str]:
    manifest = json.loads((out / "manifest.json").read_text())
    return {record["file"]: record[recorded_checksum(record)] for record in manifest["shards"].values()}


def test_values_equal_a_direct_trace(llama, tmp_path):
    docs = documents(12)
    result = harvest(
        llama,
        docs,
        ["layers.*.layer_output", "layers.1.self_attn.attention_probabilities", "final_norm_output"],
        tmp_path / "out",
        context_length=48,
        shard_bytes=40_000,
        progress=False,
    )
    assert len(result.shards) > 1
    result.verify()
    for path, shard in zip(result.shards, result):  # safetensors' own reader opens each shard as written
        written = safetensors.torch.load_file(path)
        assert written.keys() == shard.keys() and all(torch.equal(written[name], shard[name]) for name in shard)
    columns = {name: result.load(name) for name in ("documents", "offsets", "token_ids", "layers.2.layer_output")}
    pattern = result.load("layers.1.self_attn.attention_probabilities")
    assert pattern.shape[1:] == (llama.num_heads, 48)
    bos = llama.tokenizer.bos_token_id
    for index, doc in enumerate(docs):
        mine = columns["documents"] == index
        if not doc:
            assert not mine.any()
            continue
        ids = [bos, *llama.tokenizer(doc, add_special_tokens=False)["input_ids"]][:48]
        assert columns["token_ids"][mine].tolist() == ids
        assert columns["offsets"][mine].tolist() == list(range(len(ids)))
        with llama.trace(torch.tensor([ids])):
            expected_pattern = llama.layers[1].self_attn.attention_probabilities.save()
            expected = llama.layers[2].layer_output.save()
        torch.testing.assert_close(columns["layers.2.layer_output"][mine], expected[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            pattern[mine][..., : len(ids)], expected_pattern[0].transpose(0, 1), atol=1e-6, rtol=1e-5
        )
        assert torch.count_nonzero(pattern[mine][..., len(ids) :]) == 0
    manifest = result.manifest
    assert manifest["complete"] and manifest["stats"]["empty"] == docs.count("") == 1
    assert manifest["engine"] == "transformers"
    assert manifest["values"]["layers.0.layer_output"]["shape"] == [llama.hidden_size]
    assert manifest["context"]["context_length"] == 48


def test_routing_values_of_a_mixture_of_experts(tmp_path):
    """Router logits and the experts each token is routed to, per token; indices stay integers."""
    model = StandardizedTransformer(tiny.checkpoint("mixtral"))
    docs = documents(5, seed=3)
    names = ["layers.1.mlp.router_logits", "layers.1.mlp.expert_indices"]
    result = harvest(model, docs, names, tmp_path / "out", context_length=32, progress=False)
    logits, indices, columns = result.load(names[0]), result.load(names[1]), result.load("documents")
    assert indices.dtype == torch.int64 and indices.shape[1:] == (model.num_experts_per_token,)
    assert result.manifest["values"][names[0]]["shape"] == [model.num_experts]
    bos = model.tokenizer.bos_token_id
    for index, doc in enumerate(docs):
        if not doc:
            continue
        ids = [bos, *model.tokenizer(doc, add_special_tokens=False)["input_ids"]][:32]
        with model.trace(torch.tensor([ids])):
            expected_logits = model.layers[1].mlp.router_logits.save()
            expected_indices = model.layers[1].mlp.expert_indices.save()
        mine = columns == index
        torch.testing.assert_close(logits[mine], expected_logits[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(indices[mine], expected_indices[0])


def test_last_positions_and_masks(llama, tmp_path):
    docs = documents(6)
    last = harvest(llama, docs, ["layers.0.layer_output"], tmp_path / "last", positions="last", progress=False)
    assert len(last) == sum(1 for doc in docs if doc)
    assert (last.load("offsets") > 0).all()
    masked = harvest(
        llama,
        docs,
        ["layers.0.layer_output"],
        tmp_path / "mask",
        positions=lambda ids: [i % 2 == 0 for i in range(len(ids))],
        progress=False,
    )
    assert (masked.load("offsets") % 2 == 0).all()


def test_loader_and_hf_dataset(llama, tmp_path):
    result = harvest(llama, documents(5), ["layers.1.mlp_output"], tmp_path / "out", progress=False)
    dataset = result.to_hf_dataset(tmp_path / "dataset")
    assert len(dataset) == len(result)
    torch.testing.assert_close(torch.tensor(dataset[3]["layers.1.mlp_output"]), result.load("layers.1.mlp_output")[3])
    assert (tmp_path / "dataset" / "dataset_info.json").exists()
    reopened = load_harvest(tmp_path / "out")
    assert reopened.values == ["layers.1.mlp_output"] and len(reopened) == len(result)


def test_split_and_pack_never_drop_tokens(llama, tmp_path):
    docs = ["a " * 100, "b " * 10]
    split = harvest(
        llama, docs, ["layers.0.layer_output"], tmp_path / "split", context_length=32, overflow="split", progress=False
    )
    assert split.manifest["stats"]["split"] == 1
    assert len(split) == sum(len(llama.tokenizer(doc, add_special_tokens=False)["input_ids"]) + 1 for doc in docs)
    packed = harvest(
        llama, docs, ["layers.0.layer_output"], tmp_path / "pack", context_length=32, overflow="pack", progress=False
    )
    assert len(packed) >= len(split)


def test_rerun_is_a_no_op_and_other_settings_are_refused(llama, tmp_path):
    out = tmp_path / "out"
    docs = documents(8)
    harvest(llama, docs, ["layers.0.layer_output"], out, shard_bytes=20_000, progress=False)
    before = shard_digests(out)
    harvest(llama, docs, ["layers.0.layer_output"], out, shard_bytes=20_000, progress=False)
    assert shard_digests(out) == before
    with pytest.raises(HarvestError, match=r"other settings(.|\n)*values"):
        harvest(llama, docs, ["layers.1.layer_output"], out, shard_bytes=20_000, progress=False)
    replaced = harvest(llama, docs, ["layers.1.layer_output"], out, shard_bytes=20_000, overwrite=True, progress=False)
    assert replaced.values == ["layers.1.layer_output"]


@pytest.mark.parametrize(
    "values, message",
    [
        (["layers.*.no_such_value"], "unknown value 'layers.*.no_such_value'.*layers.<i>.layer_output"),
        (["layers.9.layer_output"], r"layer\(s\) \[9\] do not exist.*num_layers=3"),
        (["nonsense"], "unknown value 'nonsense'.*token_embeddings"),
        ([], "no values to harvest"),
        (["layers.0.self_attn.attention_probabilities"], "needs a context length"),
    ],
)
def test_bad_values_fail_before_any_model_work(llama, tmp_path, values, message):
    calls = []
    handle = llama._module.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            harvest(llama, documents(3), values, tmp_path / "out", progress=False)
    finally:
        handle.remove()
    assert not calls and not (tmp_path / "out").exists()


def test_bad_corpus_names_file_and_line(llama, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(CorpusError, match=r"corpus.jsonl.*2"):
        harvest(llama, corpus, ["layers.0.layer_output"], tmp_path / "out", progress=False)
    with pytest.raises(CorpusError, match="missing.txt"):
        harvest(llama, tmp_path / "missing.txt", ["layers.0.layer_output"], tmp_path / "out2", progress=False)


def test_full_disk_removes_the_partial_shard_and_resume_finishes(llama, tmp_path, monkeypatch):
    docs = documents(10)
    reference_out = tmp_path / "reference"
    harvest(llama, docs, ["layers.0.layer_output"], reference_out, shard_bytes=20_000, progress=False)
    out = tmp_path / "out"
    real_write = files_module.write_all
    written = []

    def write_then_fill_up(descriptor, buffer):
        if os.readlink(f"/proc/self/fd/{descriptor}").startswith(str(out / "shard-00001")):
            real_write(descriptor, buffer[: len(buffer) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(descriptor)
        return real_write(descriptor, buffer)

    monkeypatch.setattr(files_module, "write_all", write_then_fill_up)
    with pytest.raises(HarvestError, match="No space left on device.*partial file was removed"):
        harvest(llama, docs, ["layers.0.layer_output"], out, shard_bytes=20_000, progress=False)
    # The failed shard left nothing; a later shard written meanwhile (shards are written while the next computes)
    # may have landed, whole.
    landed = {path.name for path in out.glob("*.safetensors")}
    assert (
        not list(out.glob("*.tmp")) and "shard-00001.safetensors" not in landed and "shard-00000.safetensors" in landed
    )
    reference_files = {path.name: path.read_bytes() for path in reference_out.glob("*.safetensors")}
    assert all((out / name).read_bytes() == reference_files[name] for name in landed)
    monkeypatch.setattr(files_module, "write_all", real_write)
    harvest(llama, docs, ["layers.0.layer_output"], out, shard_bytes=20_000, progress=False)
    assert shard_digests(out) == shard_digests(reference_out)


def fails_on_the_third(compute, computed: list[int]):
    """``compute``, failing on the third unit it is given; the units computed before are added to ``computed``."""

    def failing(model, unit, job):
        if len(computed) == 2:
            raise RuntimeError("the forward failed")
        computed.append(unit.index)
        return compute(model, unit, job)

    return failing


def test_a_failure_while_the_next_shard_computes_keeps_the_shard_being_written(llama, tmp_path, monkeypatch):
    """Shards are written on a thread while the next one is computed: an error in that computation still
    finishes, records and keeps the shard under way, and the rerun computes only the rest."""
    from nnterp_vllm.harvest import run as run_module

    docs = documents(10)
    reference = harvest(
        llama, docs, ["layers.0.layer_output"], tmp_path / "reference", shard_bytes=20_000, progress=False
    )
    compute, computed = run_module.compute, []
    monkeypatch.setattr(run_module, "compute", fails_on_the_third(compute, computed))
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="the forward failed"):
        harvest(llama, docs, ["layers.0.layer_output"], out, shard_bytes=20_000, progress=False)
    assert sorted(shard_digests(out)) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert len(reference.shards) > 3
    computed.clear()
    monkeypatch.setattr(
        run_module, "compute", lambda model, unit, job: computed.append(unit.index) or compute(model, unit, job)
    )
    harvest(llama, docs, ["layers.0.layer_output"], out, shard_bytes=20_000, progress=False)
    assert computed == list(range(2, len(reference.shards)))
    assert shard_digests(out) == shard_digests(reference.path)


HARVEST_SCRIPT = """
import resource, sys
from nnterp_vllm.harvest import harvest
checkpoint, corpus, out, shard_bytes, engine = (sys.argv[1:] + ["transformers"])[:5]
kwargs = {"dtype": "float32"} if engine == "vllm" else {}
harvest(checkpoint, corpus, ["layers.*.layer_output"], out, shard_bytes=int(shard_bytes), engine=engine,
        model_kwargs=kwargs, progress=False)
print("peak_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HARVEST_SCRIPT, *map(str, args)], capture_output=True, text=True)


def recorded_shards(out: Path) -> int:
    try:
        return len(json.loads((out / "manifest.json").read_text())["shards"])
    except (OSError, ValueError):
        return 0


def test_sigkill_at_any_moment_then_rerun_gives_identical_output(llama_path, tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", documents(240, seed=5))
    complete = tmp_path / "complete"
    assert run_script(llama_path, corpus, complete, 30_000).returncode == 0
    out = tmp_path / "killed"
    for delay in (4.0, 6.0):
        process = subprocess.Popen(
            [sys.executable, "-c", HARVEST_SCRIPT, str(llama_path), str(corpus), str(out), "30000"]
        )
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait()
    finished = run_script(llama_path, corpus, out, 30_000)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert shard_digests(out) == shard_digests(complete)
    assert sorted(path.name for path in out.iterdir()) == sorted(path.name for path in complete.iterdir())


@pytest.mark.slow
def test_sigkill_of_a_vllm_harvest_then_rerun_gives_identical_output(llama_path, tmp_path):
    """The in-engine path resumes as the others do: killed once shards are recorded, then rerun, byte-identical."""
    corpus = write_jsonl(tmp_path / "corpus.jsonl", documents(120, seed=5))
    complete = tmp_path / "complete"
    done = run_script(llama_path, corpus, complete, 200_000, "vllm")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((complete / "manifest.json").read_text())["vllm_path"] == "engine"
    out = tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, "-c", HARVEST_SCRIPT, *map(str, (llama_path, corpus, out, 200_000, "vllm"))]
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None and recorded_shards(out) < 2:
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert 2 <= recorded_shards(out) < len(shard_digests(complete))
    finished = run_script(llama_path, corpus, out, 200_000, "vllm")
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert shard_digests(out) == shard_digests(complete)
    assert sorted(path.name for path in out.iterdir()) == sorted(path.name for path in complete.iterdir())


def test_memory_does_not_grow_with_the_corpus(llama_path, tmp_path):
    peaks = []
    for count in (60, 600):
        corpus = write_jsonl(tmp_path / f"corpus{count}.jsonl", documents(count, seed=count))
        result = run_script(llama_path, corpus, tmp_path / f"out{count}", 60_000)
        assert result.returncode == 0, result.stderr[-2000:]
        peaks.append(int(result.stdout.split("peak_kib")[-1]))
    assert peaks[1] <= peaks[0] * 1.1 + 20_000, peaks


def test_cli_harvest(llama_path, tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", documents(6))
    script = Path(sys.executable).with_name("nnterp-vllm")
    command = [str(script), "harvest", str(llama_path), "--corpus", str(corpus), "--values", "layers.1.layer_output"]
    result = subprocess.run([*command, "--out", str(tmp_path / "out"), "--quiet"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "load_harvest" in result.stdout and "harvested" in result.stdout
    bad = subprocess.run(
        [*command[:-1], "layers.1.nope", "--out", str(tmp_path / "bad")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown value 'layers.1.nope'" in bad.stderr and "Traceback" not in bad.stderr


def test_a_vllm_harvest_through_nnsight_equals_transformers(llama_path, tmp_path):
    """A StandardizedVLLM passed in reads through nnsight (the path for values the engine does not keep)."""
    from nnterp_vllm import StandardizedVLLM

    docs = documents(7)
    values = ["layers.*.layer_output", "layers.1.mlp_output"]
    on_hf = harvest(llama_path, docs, values, tmp_path / "hf", shard_bytes=150_000, progress=False)
    model = StandardizedVLLM(llama_path, dtype="float32", dispatch=True)
    try:
        on_vllm = harvest(model, docs, values, tmp_path / "vllm", shard_bytes=150_000, progress=False)
        # A damaged shard is recomputed on this engine too, to the same bytes.
        files = {path.name: path.read_bytes() for path in (tmp_path / "vllm").iterdir()}
        (tmp_path / "vllm" / "shard-00000.safetensors").unlink()
        harvest(model, docs, values, tmp_path / "vllm", shard_bytes=150_000, progress=False)
        assert {path.name: path.read_bytes() for path in (tmp_path / "vllm").iterdir()} == files
    finally:
        model.shutdown()
    assert on_vllm.manifest["engine"] == "vllm" and len(on_vllm.shards) > 1
    assert on_vllm.manifest["vllm_path"] == "nnsight"
    assert torch.equal(on_vllm.load("token_ids"), on_hf.load("token_ids"))
    for name in on_hf.values:
        torch.testing.assert_close(on_vllm.load(name), on_hf.load(name), atol=1e-4, rtol=1e-4)


def test_a_vllm_harvest_of_a_checkpoint_keeps_its_values_in_the_engine(llama_path, tmp_path):
    """Stream values are kept by the engine itself (the in-engine path): the values of the transformers harvest,
    the same tokens, documents and offsets, and a lost shard recomputed to the same bytes."""
    docs = documents(9)
    values = ["layers.*.layer_output", "layers.1.mlp_output", "layers.0.attention_input", "token_embeddings"]
    options = {"shard_bytes": 150_000, "progress": False}
    on_hf = harvest(llama_path, docs, values, tmp_path / "hf", **options)
    vllm = {"engine": "vllm", "model_kwargs": {"dtype": "float32"}, **options}
    on_vllm = harvest(llama_path, docs, values, tmp_path / "vllm", **vllm)
    assert on_vllm.manifest["vllm_path"] == "engine" and len(on_vllm.shards) > 1
    for name in ("token_ids", "documents", "offsets", "rows"):
        assert torch.equal(on_vllm.load(name), on_hf.load(name)), name
    assert on_vllm.values == on_hf.values
    for name in on_hf.values:
        torch.testing.assert_close(on_vllm.load(name), on_hf.load(name), atol=1e-4, rtol=1e-4)
    files = {path.name: path.read_bytes() for path in (tmp_path / "vllm").iterdir()}
    (tmp_path / "vllm" / "shard-00001.safetensors").unlink()
    harvest(llama_path, docs, values, tmp_path / "vllm", **vllm)
    assert {path.name: path.read_bytes() for path in (tmp_path / "vllm").iterdir()} == files


def engine_blocks(model) -> int:
    """How many blocks the vLLM model under ``model`` (either path's) iterates: its block range's end."""
    runner = model.llm if hasattr(model, "llm") else model.vllm_entrypoint
    return runner.llm_engine.model_executor.driver_worker.worker.model_runner.model.model.end_layer


@pytest.mark.parametrize(
    "values, path",
    [
        pytest.param(["layers.1.layer_output", "layers.0.mlp_output"], "engine", marks=pytest.mark.slow),
        (["layers.1.layer_output", "layers.0.self_attn.attention_keys"], "nnsight"),
    ],
)
def test_a_vllm_harvest_of_a_checkpoint_runs_only_the_blocks_it_reads(llama_path, tmp_path, monkeypatch, values, path):
    from nnterp_vllm.harvest import run as run_module

    ran: list[int] = []  # the blocks vLLM's own model ran (nnsight's eager engine: recorded on its worker)
    blocks: list[int] = []  # the block range the engine was built to iterate
    load = run_module.load_model

    def recorded(*args, **kwargs):
        model = load(*args, **kwargs)
        if model.ENGINE == "vllm":
            blocks.append(engine_blocks(model))
            if path == "nnsight":
                worker = model.vllm_entrypoint.llm_engine.model_executor.driver_worker.worker
                for index, block in enumerate(worker.model_runner.model.model.layers):
                    block.register_forward_pre_hook(lambda module, args, index=index: ran.append(index))
        return model

    monkeypatch.setattr(run_module, "load_model", recorded)
    docs = documents(7)
    on_hf = harvest(llama_path, docs, values, tmp_path / "hf", progress=False)
    on_vllm = harvest(
        llama_path, docs, values, tmp_path / "vllm", engine="vllm", model_kwargs={"dtype": "float32"}, progress=False
    )
    assert on_vllm.manifest["vllm_path"] == path and blocks == [2]
    assert on_vllm.manifest["blocks_run"] == on_hf.manifest["blocks_run"] == 2
    assert sorted(set(ran)) == ([0, 1] if path == "nnsight" else [])
    for name in values:
        torch.testing.assert_close(on_vllm.load(name), on_hf.load(name), atol=1e-4, rtol=1e-4)
    if path == "nnsight":
        return
    blocks.clear()  # a value after the blocks needs them all
    whole = harvest(
        llama_path,
        docs[:2],
        ["layers.0.layer_output", "final_norm_output"],
        tmp_path / "all",
        engine="vllm",
        model_kwargs={"dtype": "float32"},
        progress=False,
    )
    count = json.loads((llama_path / "config.json").read_text())["num_hidden_layers"]
    assert blocks == [count] and whole.manifest["blocks_run"] == count > 2


def test_a_vllm_model_built_to_run_fewer_blocks_harvests_only_what_they_reach(llama_path, tmp_path):
    from nnterp_vllm import StandardizedVLLM
    from nnterp_vllm.engines.first_blocks import FIRST_BLOCKS

    model = StandardizedVLLM(llama_path, dtype="float32", additional_config={FIRST_BLOCKS: 1})
    try:
        done = harvest(model, documents(3), ["layers.0.layer_output"], tmp_path / "zero", progress=False)
        assert done.manifest["blocks_run"] == 1
        refusal = r"runs only its first 1 blocks \(additional_config nnterp_vllm_first_blocks\), short of the values"
        with pytest.raises(ValueError, match=refusal + r" selected, which need 2: build it without that setting"):
            harvest(model, documents(3), ["layers.1.layer_output"], tmp_path / "one", progress=False)
    finally:
        model.shutdown()


def test_ray_workers_write_what_one_worker_writes(llama_path, tmp_path):
    docs = documents(30, seed=3)
    single = harvest(
        llama_path, docs, ["layers.*.layer_output"], tmp_path / "single", shard_bytes=15_000, progress=False
    )
    fanned = harvest(
        llama_path, docs, ["layers.*.layer_output"], tmp_path / "ray", shard_bytes=15_000, workers=2, progress=False
    )
    assert len(fanned.shards) == len(single.shards) > 2
    for name in ("token_ids", "documents", "offsets", "rows"):
        assert torch.equal(fanned.load(name), single.load(name))
    for name in single.values:
        torch.testing.assert_close(fanned.load(name), single.load(name), atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------ speed-minded choices


class WeightsUsed(torch.overrides.TorchFunctionMode):
    """Records which of some named weights any torch function was called with."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.weights = {id(weight): name for name, weight in weights.items()}
        self.used: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for argument in args:
            name = self.weights.get(id(argument))
            if name is not None and name not in self.used:
                self.used.append(name)
        return func(*args, **(kwargs or {}))


def test_the_forward_stops_after_the_deepest_value(llama, tmp_path):
    """Nothing runs past the deepest value read: the later blocks and the head never run."""
    prompt = torch.tensor([[1, 70, 71]])
    with llama.trace(prompt):  # dispatched: the weights are the ones that run
        llama.logits.save()
    layers = llama._module.model.layers
    weights = {"layer 1": layers[1].mlp.down_proj.weight, "layer 2": layers[2].self_attn.q_proj.weight}
    weights["head"] = llama._module.lm_head.weight
    with WeightsUsed(weights) as seen, llama.trace(prompt):
        llama.logits.save()
    assert seen.used == ["layer 1", "layer 2", "head"]  # the check itself sees a whole forward
    with WeightsUsed(weights) as seen:
        harvest(llama, documents(4), ["layers.0.layer_output"], tmp_path / "zero", progress=False)
    assert seen.used == []
    with WeightsUsed(weights) as seen:
        harvest(llama, documents(4), ["layers.1.mlp_output"], tmp_path / "one", progress=False)
    assert seen.used == ["layer 1"]


def test_sdpa_unless_an_attention_interior_value_is_read(llama_path, llama, tmp_path):
    docs = documents(6)
    values = ["layers.*.layer_output", "layers.1.mlp_output"]
    fast = harvest(llama_path, docs, values, tmp_path / "sdpa", progress=False)
    eager = harvest(
        llama_path, docs, values, tmp_path / "eager", model_kwargs={"attn_implementation": "eager"}, progress=False
    )
    assert (fast.manifest["attention"], eager.manifest["attention"]) == ("sdpa", "eager")
    for name in values[1:] + [f"layers.{i}.layer_output" for i in range(3)]:
        torch.testing.assert_close(fast.load(name), eager.load(name), atol=1e-5, rtol=1e-5)
    pattern = ["layers.1.self_attn.attention_probabilities"]
    interior = harvest(llama_path, docs, pattern, tmp_path / "interior", context_length=48, progress=False)
    assert interior.manifest["attention"] == "eager"
    passed_in = harvest(llama, docs, values, tmp_path / "own", progress=False)
    assert passed_in.manifest["attention"] == llama._module.config._attn_implementation == "eager"


@pytest.fixture(scope="module")
def harvests(llama, tmp_path_factory):
    """The same corpus harvested in both layouts, packed into rows of 32 tokens."""
    root = tmp_path_factory.mktemp("layouts")
    values = ["layers.1.layer_output", "layers.2.mlp_output"]
    options = {"context_length": 32, "shard_bytes": 40_000, "progress": False}
    default = harvest(llama, documents(16, seed=7), values, root / "safetensors", overflow="pack", **options)
    sae_lens = harvest(llama, documents(16, seed=7), values, root / "sae-lens", format="sae-lens", **options)
    return default, sae_lens


def test_sae_lens_layout_is_the_dataset_saelens_reads(llama, harvests, tmp_path):
    import datasets

    default, sae_lens = harvests
    assert sae_lens.manifest["values"]["layers.1.layer_output"]["module"] == "model.layers.1"
    assert default.manifest["values"]["layers.2.mlp_output"]["module"] == "model.layers.2.mlp"
    dataset = datasets.load_from_disk(str(sae_lens.path))
    assert dataset.features["model.layers.1"] == datasets.Array2D((32, 128), "float32")
    assert dataset.features["token_ids"] == datasets.Sequence(datasets.Value("int32"), length=32)
    rows = len(dataset)
    assert rows * 32 == len(sae_lens) and sae_lens.manifest["stats"]["left_out"] == len(default) - rows * 32 > 0
    first = dataset.with_format("torch")[:rows]
    torch.testing.assert_close(
        first["model.layers.2.mlp"].reshape(-1, 128), default.load("layers.2.mlp_output")[: rows * 32]
    )
    assert torch.equal(first["token_ids"].reshape(-1).long(), default.load("token_ids")[: rows * 32])
    assert torch.equal(sae_lens.load("documents"), default.load("documents")[: rows * 32])
    # Resumable like the default layout: a lost shard is recomputed to the same bytes, dataset files included.
    out = tmp_path / "copy"
    shutil.copytree(sae_lens.path, out)
    files = {path.name: path.read_bytes() for path in out.iterdir()}
    (out / "data-00001.arrow").unlink()
    harvest(
        llama,
        documents(16, seed=7),
        sae_lens.values,
        out,
        format="sae-lens",
        context_length=32,
        shard_bytes=40_000,
        progress=False,
    )
    assert {path.name: path.read_bytes() for path in out.iterdir()} == files


class TestAHarvestOnASteeredVLLM:
    """A `SteeredVLLM` passed in, built to keep the values, harvests on the in-engine path: either layout, any
    positions, the values of the transformers harvest."""

    VALUES = ["layers.1.layer_output", "layers.2.mlp_output"]

    @pytest.fixture(scope="class")
    def engine(self, llama_path):
        from nnterp_vllm import SteeredVLLM
        from nnterp_vllm.harvest.in_engine import engine_settings
        from nnterp_vllm.specs.selection import check_selectors

        # Built as the harvest builds its own engine: capture only, no steering operation.
        model = SteeredVLLM(llama_path, **engine_settings(check_selectors(self.VALUES, None), {"dtype": "float32"}))
        yield model
        model.shutdown()

    def test_the_engine_the_harvest_builds_runs_no_steering_operation_and_refuses_steering(self, engine):
        from nnterp_vllm import Steering

        (stats,) = engine.steering_stats()
        assert stats["operations"] == 0 and stats["entries"] == 0
        with pytest.raises(ValueError, match=r"need 1 distinct block contents of the engine's steering pool, which "):
            engine.generate("Hello", steering=Steering(1, torch.ones(engine.hidden_size)), use_tqdm=False)

    def test_the_sae_lens_layout_holds_the_transformers_harvest(self, engine, harvests, tmp_path):
        import datasets

        _, sae_lens = harvests
        options = {"context_length": 32, "shard_bytes": 40_000, "progress": False}
        kept = harvest(engine, documents(16, seed=7), self.VALUES, tmp_path / "kept", format="sae-lens", **options)
        assert kept.manifest["vllm_path"] == "engine" and kept.manifest["values"] == sae_lens.manifest["values"]
        assert len(kept.shards) == len(sae_lens.shards) > 1
        ours, theirs = (datasets.load_from_disk(str(h.path)).with_format("torch")[:] for h in (kept, sae_lens))
        assert torch.equal(ours["token_ids"], theirs["token_ids"])
        for column in ("model.layers.1", "model.layers.2.mlp"):
            torch.testing.assert_close(ours[column], theirs[column], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kept.load("layers.1.layer_output"), sae_lens.load("layers.1.layer_output"))

    def test_last_positions_and_masks_hold_the_transformers_harvest(self, engine, llama, tmp_path):
        docs = documents(8)
        for positions in ("last", lambda ids: [i % 3 == 1 for i in range(len(ids))]):
            kept, read = (
                harvest(
                    model, docs, self.VALUES, tmp_path / f"{name}-{id(positions)}", positions=positions, progress=False
                )
                for name, model in (("engine", engine), ("transformers", llama))
            )
            assert kept.manifest["vllm_path"] == "engine" and len(kept) == len(read) > 0
            for name in ("token_ids", "documents", "offsets"):
                assert torch.equal(kept.load(name), read.load(name)), name
            for name in self.VALUES:
                torch.testing.assert_close(kept.load(name), read.load(name), atol=1e-4, rtol=1e-4)

    def test_a_value_the_engine_does_not_keep_is_refused_before_any_work(self, engine, tmp_path):
        with pytest.raises(ValueError, match="layers.0.layer_output is not available.*built to keep layers.1"):
            harvest(engine, documents(3), ["layers.0.layer_output"], tmp_path / "out", progress=False)
        with pytest.raises(ValueError, match="attention_queries is not available.*read it through nnsight"):
            harvest(engine, documents(3), ["layers.1.self_attn.attention_queries"], tmp_path / "out", progress=False)
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"values": ["layers.1.layer_input"]}, "layers.1.layer_input is no module's output"),
        ({"values": ["layers.1.attention_output", "layers.1.self_attn.attention_output"]}, "both the output of"),
        ({"context_length": None}, "give a context_length"),
        ({"overflow": "truncate"}, "overflow must be 'pack'"),
        ({"positions": "last"}, "positions must be 'all'"),
        ({"dtype": "bfloat16"}, "'float32' or 'float16'"),
    ],
)
def test_what_the_sae_lens_layout_cannot_hold_is_refused(llama, tmp_path, kwargs, message):
    arguments = {"values": ["layers.1.layer_output"], "context_length": 32, **kwargs}
    with pytest.raises(ValueError, match=message):
        harvest(llama, documents(3), out=tmp_path / "out", format="sae-lens", progress=False, **arguments)
    assert not (tmp_path / "out").exists()


#: A small shuffle window: 22 batches of 7 tokens of the three columns read (528 bytes a token), in 16 chunks.
BUFFER = 160 * 528


def mapped_shards(directory: Path) -> bool:
    """Whether this process has any file of ``directory`` mapped (from /proc/self/maps)."""
    return str(directory) in Path("/proc/self/maps").read_text()


def test_batches_visit_every_token_once_per_epoch(harvests, monkeypatch):
    windows: list[int] = []  # tokens read per window
    allocated: list[int] = []  # bytes of each batch buffer allocated (not reused)
    window, allocate = reader_module._Scatter.window, reader_module._Buffers.allocate

    def counted(self, window_pieces, starts, order, batch_size):
        windows.append(len(order))
        return window(self, window_pieces, starts, order, batch_size)

    def allocations(size):
        allocated.append(size)
        return allocate(size)

    monkeypatch.setattr(reader_module._Scatter, "window", counted)
    monkeypatch.setattr(reader_module._Buffers, "allocate", staticmethod(allocations))
    for result in harvests:
        result = load_harvest(result.path)  # opened anew: no batch buffers kept from an earlier epoch
        names = ["layers.1.layer_output", "documents", "offsets"]
        every = {name: result.load(name) for name in names}
        sequential = list(result.batches(7, shuffle=False, values=names))
        assert all(len(batch["documents"]) == 7 for batch in sequential[:-1])
        for name in names:
            assert torch.equal(torch.cat([batch[name] for batch in sequential]), every[name])
        # Many windows, each of chunks cut where the window ends, every batch held: none of their buffers reused.
        windows[:], allocated[:] = [], []
        shuffled = list(result.batches(7, seed=3, values=names, buffer_bytes=BUFFER))
        assert len(windows) > 3 and max(windows) * 528 <= BUFFER and sum(windows) == len(every["documents"])
        assert len(allocated) == len(shuffled)
        order = torch.cat([batch["documents"] * 1000 + batch["offsets"] for batch in shuffled])
        keys = every["documents"] * 1000 + every["offsets"]
        assert sorted(order.tolist()) == sorted(keys.tolist()) and len(set(keys.tolist())) == len(keys)
        assert not torch.equal(order, keys)
        position = {key: i for i, key in enumerate(keys.tolist())}
        mine = torch.tensor([position[key] for key in order.tolist()])
        torch.testing.assert_close(torch.cat([b["layers.1.layer_output"] for b in shuffled]), every[names[0]][mine])
        # Each batch dropped once used: the buffers (the held epoch's, now free) are reused, the batches the
        # same; no shard is ever mapped.
        allocated[:], again, kept = [], [], []
        for number, batch in enumerate(result.batches(7, seed=3, values=names, buffer_bytes=BUFFER)):
            assert not mapped_shards(result.path)
            again.append(batch["documents"].clone())
            if number % 10 == 0:  # a view kept of some: their buffers stay the caller's
                kept.append((number, batch["layers.1.layer_output"][1:]))
            assert torch.equal(batch["layers.1.layer_output"], shuffled[number]["layers.1.layer_output"])
        assert len(allocated) < len(shuffled) / 2 and torch.equal(torch.cat(again), order // 1000)
        assert all(torch.equal(view, shuffled[number]["layers.1.layer_output"][1:]) for number, view in kept)
        other = torch.cat([b["documents"] for b in result.batches(7, seed=4, values=names, buffer_bytes=BUFFER)])
        assert not torch.equal(other, order // 1000)
        dropped = list(result.batches(7, seed=3, values=names, drop_last=True))
        assert all(len(batch["offsets"]) == 7 for batch in dropped) and len(dropped) == len(keys) // 7
    with pytest.raises(ValueError, match=r"\['nope'\] are not in this harvest"):
        next(harvests[0].batches(7, values=["nope"]))


def test_threads_reading_one_harvest_each_get_their_own_batches(harvests):
    """Two threads, each an epoch of the same harvest, letting each batch go after copying it: every batch
    equals the single-threaded epoch's (no buffer is taken by both while the other still fills or reads it)."""
    result, name = load_harvest(harvests[0].path), "layers.1.layer_output"
    expected = [batch[name].clone() for batch in result.batches(7, seed=1, values=[name], buffer_bytes=BUFFER)]
    copies: list[list[torch.Tensor]] = [[], []]

    def epoch(number: int) -> None:
        for batch in result.batches(7, seed=1, values=[name], buffer_bytes=BUFFER):
            copies[number].append(batch[name].clone())

    threads = [threading.Thread(target=epoch, args=(number,)) for number in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for copied in copies:
        assert len(copied) == len(expected) and all(torch.equal(a, b) for a, b in zip(copied, expected))


TRAINER_SCRIPT = """
import copy, json, sys
from nnterp_vllm import load_harvest
default, sae_lens, text, model = sys.argv[1:5]
harvest = load_harvest(sae_lens)
acts = harvest.load("layers.1.layer_output")
next(load_harvest(default).batches(64))
loaded = sorted(name for name in sys.modules if name.split(".")[0] in ("nnsight", "vllm"))
import torch
from sae_lens import LanguageModelSAERunnerConfig, LanguageModelSAETrainingRunner, LoggingConfig
from sae_lens import StandardTrainingSAE, StandardTrainingSAEConfig
sae_config = StandardTrainingSAEConfig(d_in=128, d_sae=256, l1_coefficient=1e-3)
config = LanguageModelSAERunnerConfig(
    sae=sae_config, model_name=model, model_class_name="AutoModelForCausalLM",
    hook_name=harvest.manifest["values"]["layers.1.layer_output"]["column"],
    dataset_path=text, streaming=False, is_dataset_tokenized=False, context_size=32,
    use_cached_activations=True, cached_activations_path=sae_lens,
    train_batch_size_tokens=128, training_tokens=128 * 200, n_batches_in_buffer=4, store_batch_size_prompts=4,
    lr=3e-3, device="cpu", logger=LoggingConfig(log_to_wandb=False), output_path=None, checkpoint_path=None,
    verbose=False,
)
sae = StandardTrainingSAE(sae_config)
untrained = copy.deepcopy(sae)
def loss(model):
    with torch.no_grad():
        return float(((model(acts) - acts) ** 2).mean())
trained = LanguageModelSAETrainingRunner(config, override_sae=sae).run()
print(json.dumps({"loaded": loaded, "before": loss(untrained), "after": loss(trained)}))
"""


def test_saelens_trains_from_a_harvest_in_an_environment_without_nnsight(harvests, tmp_path):
    """A trainer opens a harvest without importing nnsight or vLLM, and SAELens's own runner trains an
    SAE from the sae-lens layout as it is (it also loads its model and a text dataset: both local here)."""
    default, sae_lens = harvests
    (tmp_path / "text").mkdir()
    write_jsonl(tmp_path / "text" / "train.jsonl", documents(4))
    arguments = [default.path, sae_lens.path, tmp_path / "text", sae_lens.manifest["model"]]
    result = subprocess.run(
        [sys.executable, "-c", TRAINER_SCRIPT, *map(str, arguments)], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["loaded"] == []
    assert report["after"] < report["before"] / 4, report
