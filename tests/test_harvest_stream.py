"""The in-engine harvest as one stream: fed across shards, rows kept in shared memory, writes queued within a bound,
the engine in the harvest's process unless told otherwise; every arrangement equal to the transformers harvest."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading

import pytest
import tiny
import torch
from test_harvest import documents

from nnterp_vllm.harvest import HarvestError, harvest
from nnterp_vllm.harvest import run as run_module

VALUES = ["layers.*.layer_output", "layers.1.mlp_output"]
OPTIONS = {"shard_bytes": 20_000, "progress": False}


@pytest.fixture(scope="module")
def on_transformers(llama_path, tmp_path_factory):
    return harvest(llama_path, documents(24, seed=3), VALUES, tmp_path_factory.mktemp("hf") / "out", **OPTIONS)


def open_files() -> list[str]:
    """What this process's file descriptors point at."""
    found = []
    for descriptor in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        except FileNotFoundError:  # the descriptor listing the directory, closed since
            pass
    return found


def assert_safetensors_files(harvested) -> None:
    """Each shard file is one that the safetensors library reads, holding the harvest's columns."""
    from safetensors.torch import load_file

    offset = 0
    for shard in harvested.shards:
        tensors = load_file(shard)
        assert set(tensors) == {*harvested.values, "token_ids", "documents", "offsets", "rows"}
        tokens = len(tensors["token_ids"])
        for name in harvested.values:
            assert torch.equal(tensors[name], harvested.load(name)[offset : offset + tokens]), (shard, name)
        offset += tokens
    assert offset == len(harvested)


def assert_same_harvest(harvested, reference) -> None:
    for name in ("token_ids", "documents", "offsets", "rows"):
        assert torch.equal(harvested.load(name), reference.load(name)), name
    assert harvested.values == reference.values
    for name in reference.values:
        torch.testing.assert_close(harvested.load(name), reference.load(name), atol=1e-4, rtol=1e-4)


def test_the_engine_runs_in_process_and_is_fed_across_shards(llama_path, on_transformers, tmp_path, monkeypatch):
    """Unless told otherwise the harvest runs its own engine in its process (and leaves vLLM's setting as it found
    it); the engine is never drained at a shard's end: the whole corpus takes the steps its tokens need, not one or
    more per shard."""
    from vllm.v1.engine.llm_engine import LLMEngine

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    steps = []
    step = LLMEngine.step

    def counted(self):
        steps.append(self.get_num_unfinished_requests())
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", counted)
    vllm = {"engine": "vllm", "model_kwargs": {"dtype": "float32"}}
    harvested = harvest(llama_path, documents(24, seed=3), VALUES, tmp_path / "out", **vllm, **OPTIONS)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    manifest = harvested.manifest
    assert manifest["vllm_path"] == "engine" and manifest["engine_process"] == "in-process"
    assert len(harvested.shards) >= 6
    assert len(steps) <= math.ceil(len(harvested) / 2048) + 1, (len(steps), len(harvested.shards))
    assert_same_harvest(harvested, on_transformers)


def test_an_engine_in_its_own_process_fills_the_shared_rows(llama_path, on_transformers, tmp_path, monkeypatch):
    """Where the caller keeps vLLM's engine core in a process of its own, that process writes the rows into the
    shard files themselves (none is left open here, no temporary file left, nothing of ours in /dev/shm)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    vllm = {"engine": "vllm", "model_kwargs": {"dtype": "float32"}}
    harvested = harvest(llama_path, documents(24, seed=3), VALUES, tmp_path / "out", **vllm, **OPTIONS)
    assert harvested.manifest["engine_process"] == "own process"
    assert_same_harvest(harvested, on_transformers)
    assert_safetensors_files(harvested)
    assert not list((tmp_path / "out").glob("*.tmp"))
    assert not [target for target in open_files() if str(tmp_path) in target]
    assert not [name for name in os.listdir("/dev/shm") if "nnterp" in name]
    assert not [target for target in open_files() if "nnterp-vllm-rows" in target]


@pytest.fixture(scope="class")  # stopped after its class: one in-process engine at a time
def engine(llama_path):
    from nnterp_vllm import SteeredVLLM

    model = SteeredVLLM(llama_path, dtype="float32", capture_values=VALUES, enable_prefix_caching=False)
    yield model
    model.shutdown()


class TestOnASteeredVLLM:
    def test_rows_a_worker_cannot_place_in_shared_memory_are_copied_in(self, engine, on_transformers, tmp_path):
        """A worker that cannot map the region (on another host) keeps the rows itself; the client puts them in
        place: the same bytes as rows written in place."""
        from nnterp_vllm.engines.steered import kept_rows as capture

        docs = documents(24, seed=3)
        in_place = harvest(engine, docs, VALUES, tmp_path / "in-place", **OPTIONS)
        assert engine.capture_stats()[0]["regions_mapped"] == 0  # each let go of once its shard was taken
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(capture, "open_region", lambda into, dtype: None)
            copied = harvest(engine, docs, VALUES, tmp_path / "copied", **OPTIONS)
        assert_same_harvest(in_place, on_transformers)
        assert_safetensors_files(in_place)
        for left, right in zip(in_place.shards, copied.shards):
            assert left.read_bytes() == right.read_bytes()

    def test_rows_that_cannot_reach_an_unopenable_shard_are_never_recorded_as_zeros(
        self, engine, tmp_path, monkeypatch
    ):
        """The worker cannot open the shard file (its destination names a path that is not there): it keeps the
        rows in its own memory, and once more requests finished than it holds (`FINISHED_KEPT`, made 2 here) it
        drops the oldest. The harvest then fails naming the shard and the cause, records no shard missing rows (the
        shards before it, whose rows were taken in time, land as the reference's) and leaves no partial file; a
        rerun where the worker can open the files finishes with the same bytes as a harvest that never failed."""
        from nnterp_vllm.engines.steered import kept_rows as capture
        from nnterp_vllm.engines.steered.shared_rows import SharedRows

        docs, options = documents(40, seed=3), {**OPTIONS, "positions": "last"}  # about ten rows a shard
        reference = harvest(engine, docs, VALUES, tmp_path / "reference", **options)
        destination = SharedRows.destination
        monkeypatch.setattr(
            SharedRows, "destination", lambda self, first: {**destination(self, first), "path": "/gone"}
        )
        kept_in_worker = harvest(engine, docs, VALUES, tmp_path / "kept", **options)  # within the bound: copied in
        assert [p.read_bytes() for p in kept_in_worker.shards] == [p.read_bytes() for p in reference.shards]
        monkeypatch.setattr(capture, "FINISHED_KEPT", 2)
        out = tmp_path / "out"
        never_reached = r"rows of shard \d+ never reached it, so it is not recorded.*could not"
        with pytest.raises(HarvestError, match=never_reached) as failed:
            harvest(engine, docs, VALUES, out, **options)
        # Which shard's rows are dropped first depends on when the client takes them; none is recorded with zeros:
        # every shard that landed before it holds the reference's bytes, and nothing else is left.
        lost = int(re.search(r"rows of shard (\d+)", str(failed.value)).group(1))
        reference_bytes = {p.name: p.read_bytes() for p in reference.shards}
        left = sorted(p for p in out.iterdir() if p.name.startswith("shard-")) if out.exists() else []
        assert all(p.name in reference_bytes and p.read_bytes() == reference_bytes[p.name] for p in left), left
        assert len(left) <= lost
        assert engine.capture_stats()[0]["finished_held"] == 0
        monkeypatch.setattr(SharedRows, "destination", destination)
        rerun = harvest(engine, docs, VALUES, out, **options)
        assert len(reference.shards) > 1
        assert [p.read_bytes() for p in rerun.shards] == [p.read_bytes() for p in reference.shards]

    def test_a_failed_write_stops_the_stream_and_leaves_the_engine_clean(self, engine, tmp_path, monkeypatch):
        """A write that fails ends the harvest with its error; the requests still in the engine are aborted and
        their rows let go; the shards written before it stay recorded and the engine serves the next harvest."""
        write = run_module.write_unit
        written = []

        def failing(unit, columns, job, placed):
            if len(written) == 2:
                raise OSError(28, "No space left on device")
            written.append(unit.index)
            return write(unit, columns, job, placed)

        monkeypatch.setattr(run_module, "write_unit", failing)
        with pytest.raises(OSError, match="No space left"):
            harvest(engine, documents(24, seed=3), VALUES, tmp_path / "out", **OPTIONS)
        manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
        assert sorted(int(index) for index in manifest["shards"]) == [0, 1]
        stats = engine.capture_stats()[0]
        assert stats["regions_mapped"] == 0 and stats["finished_held"] == 0
        monkeypatch.setattr(run_module, "write_unit", write)
        resumed = harvest(engine, documents(24, seed=3), VALUES, tmp_path / "out", **OPTIONS)
        assert resumed.manifest["complete"]
        assert not list((tmp_path / "out").glob("*.tmp"))

    def test_a_full_disk_as_a_shard_file_begins_names_it_and_resume_finishes(
        self, engine, on_transformers, tmp_path, monkeypatch
    ):
        """A shard file's disk space is taken as it begins, before the engine fills it: a full disk then is the
        harvest's clear error, with no partial file left and the shards before it kept; the rerun finishes."""
        from nnterp_vllm.harvest import layouts

        allocate, begun = os.posix_fallocate, []

        def full_on_the_third(descriptor, offset, length):
            begun.append(length)
            if len(begun) == 3:
                raise OSError(28, "No space left on device")
            allocate(descriptor, offset, length)

        monkeypatch.setattr(layouts.os, "posix_fallocate", full_on_the_third)
        with pytest.raises(HarvestError, match=r"cannot write shard-00002.*No space left on device.*was removed"):
            harvest(engine, documents(24, seed=3), VALUES, tmp_path / "out", **OPTIONS)
        assert not list((tmp_path / "out").glob("*.tmp"))
        assert engine.capture_stats()[0]["regions_mapped"] == 0
        monkeypatch.setattr(layouts.os, "posix_fallocate", allocate)
        resumed = harvest(engine, documents(24, seed=3), VALUES, tmp_path / "out", **OPTIONS)
        assert_same_harvest(resumed, on_transformers)
        assert_safetensors_files(resumed)

    def test_shards_of_many_chunks_go_straight_to_disk_checksummed_as_written(
        self, engine, llama_path, tmp_path, monkeypatch
    ):
        """Shards spanning several chunks have their whole chunks written from memory, each hashed as it is written
        (nothing is read back to checksum a shard): the files hold the transformers harvest's values, their
        checksums are the ones a fresh check computes from the files, and a byte changed on disk is caught."""
        from nnterp_vllm import load_harvest
        from nnterp_vllm.checksums import CHUNK, CHUNKED
        from nnterp_vllm.engines.steered import shared_rows

        hashed, digest = [], shared_rows.chunk_digest
        monkeypatch.setattr(shared_rows, "chunk_digest", lambda data: hashed.append(len(data)) or digest(data))
        docs = documents(400, seed=5)
        options = {**OPTIONS, "shard_bytes": 4 * CHUNK}
        harvested = harvest(engine, docs, VALUES, tmp_path / "vllm", **options)
        reference = harvest(llama_path, docs, VALUES, tmp_path / "hf", **options)
        assert_same_harvest(harvested, reference)
        assert_safetensors_files(harvested)
        sizes = [shard.stat().st_size for shard in harvested.shards]
        assert len(sizes) >= 3 and all(size > 3 * CHUNK for size in sizes[:-1])
        assert len(hashed) >= sum(size // CHUNK - 1 for size in sizes)  # each shard's whole chunks past its first
        assert all(CHUNKED in record for record in harvested.records)
        load_harvest(tmp_path / "vllm").verify()
        damaged = harvested.shards[1]
        with open(damaged, "r+b") as handle:
            handle.seek(2 * CHUNK + 7)
            byte = handle.read(1)
            handle.seek(2 * CHUNK + 7)
            handle.write(bytes([byte[0] ^ 1]))
        with pytest.raises(HarvestError, match=rf"{damaged.name} .* is damaged: its checksum differs"):
            load_harvest(tmp_path / "vllm").verify()


def test_a_slow_writer_holds_the_computation_back_only_once_its_queue_is_full(tmp_path, monkeypatch):
    """The writer takes `WRITES_QUEUED` shards before `put` waits; records come in order."""
    release = threading.Event()
    started = []

    def slow(unit, columns, job, placed):
        started.append(unit.index)
        release.wait(30)
        return {"index": unit.index}

    monkeypatch.setattr(run_module, "write_unit", slow)
    recorded = []
    writer = run_module.BackgroundWriter(None, lambda index, record: recorded.append(index))
    with writer:
        for index in range(run_module.WRITES_QUEUED):
            writer.put(run_module.Unit(index), {})
        assert len(writer.pending) == run_module.WRITES_QUEUED and recorded == []
        blocked = threading.Thread(target=writer.put, args=(run_module.Unit(9), {}))
        blocked.start()
        blocked.join(0.5)
        assert blocked.is_alive()  # waits for room in the queue
        release.set()
        blocked.join(30)
        assert not blocked.is_alive()
    assert recorded == [*range(run_module.WRITES_QUEUED), 9]


def test_shared_rows_written_by_another_process_are_seen_here():
    from nnterp_vllm.engines.steered.shared_rows import SharedRows, open_region

    region = SharedRows(2, 5, 3, torch.float32)
    into = region.destination(first=1)
    code = (
        "import sys, torch, json; from nnterp_vllm.engines.steered.shared_rows import open_region; "
        "region = open_region(json.loads(sys.argv[1]), torch.float32); region.put(1, torch.full((2, 4, 3), 7.0))"
    )
    done = subprocess.run([sys.executable, "-c", code, json.dumps(into)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert torch.equal(region.tensor[:, 1:], torch.full((2, 4, 3), 7.0))
    assert torch.equal(region.tensor[:, 0], torch.zeros(2, 3))
    assert "lies on elsewhere" in open_region({**into, "host": "elsewhere"}, torch.float32)
    region.close()
    assert "cannot open" in open_region(into, torch.float32)  # closed: nothing left to open


def test_a_vllm_harvest_of_the_pattern_and_the_experts_choice_reads_them_through_nnsight(tmp_path):
    """Values the engine does not keep (the attention pattern, the experts' choice) are harvested on vLLM through
    nnsight, equal to the transformers harvest (experts compared in expert order); the manifest says so."""
    path = tiny.checkpoint("mixtral")
    values = [
        "layers.1.self_attn.attention_probabilities",
        "layers.0.mlp.expert_indices",
        "layers.0.mlp.expert_weights",
    ]
    options = {"context_length": 24, "progress": False}
    on_hf = harvest(path, documents(6, seed=2), values, tmp_path / "hf", **options)
    on_vllm = harvest(path, documents(6, seed=2), values, tmp_path / "vllm", engine="vllm", **options)
    assert on_vllm.manifest["vllm_path"] == "nnsight" and on_hf.manifest["vllm_path"] is None
    assert torch.equal(on_vllm.load("token_ids"), on_hf.load("token_ids"))
    name = "layers.1.self_attn.attention_probabilities"
    torch.testing.assert_close(on_vllm.load(name), on_hf.load(name), atol=1e-4, rtol=1e-4)
    choices = []
    for harvested in (on_hf, on_vllm):
        indices, weights = harvested.load("layers.0.mlp.expert_indices"), harvested.load("layers.0.mlp.expert_weights")
        order = indices.argsort(dim=-1)
        choices.append((indices.gather(-1, order), weights.gather(-1, order)))
    assert torch.equal(choices[0][0], choices[1][0])
    torch.testing.assert_close(choices[0][1], choices[1][1], atol=1e-4, rtol=1e-4)


def region_in_file(path, values: int, rows: int, hidden: int, start: int):
    """A file holding ``start`` bytes of header and room for a ``[values, rows, hidden]`` float32 region after it, as
    a harvest begins a shard; the region over it and the worker's hold of it."""
    from nnterp_vllm.engines.steered.shared_rows import SharedRows, open_region

    header = bytes(range(256)) * (start // 256) + bytes(start % 256)
    path.write_bytes(header)
    with open(path, "r+b") as handle:
        os.posix_fallocate(handle.fileno(), 0, start + values * rows * hidden * 4)
    shared = SharedRows(values, rows, hidden, torch.float32, file=path, start=start)
    region = open_region(shared.destination(0), torch.float32)
    assert region is not None
    return header, shared, region


def written_in_steps(region, expected: torch.Tensor, seed: int) -> None:
    """Write ``expected`` ``[values, rows, hidden]`` into ``region`` as an engine does: a run of rows of every value
    at a time, the runs in a shuffled order."""
    generator = torch.Generator().manual_seed(seed)
    runs, row = [], 0
    while row < expected.shape[1]:
        length = int(torch.randint(1, 300, (1,), generator=generator))
        runs.append((row, min(length, expected.shape[1] - row)))
        row += length
    for index in torch.randperm(len(runs), generator=generator).tolist():
        first, length = runs[index]
        region.put(first, expected[:, first : first + length])


def assert_file_holds(path, header: bytes, expected: torch.Tensor) -> None:
    data = path.read_bytes()
    assert data[: len(header)] == header
    assert data[len(header) :] == expected.numpy().tobytes()


def chunk_digests_from_file(path) -> dict[int, bytes]:
    from nnterp_vllm.checksums import CHUNK, chunk_digest

    data = path.read_bytes()
    return {chunk: chunk_digest(data[chunk * CHUNK : (chunk + 1) * CHUNK]) for chunk in range(-(-len(data) // CHUNK))}


def test_a_shard_region_is_written_a_chunk_at_a_time_with_digests_hashed_as_written(tmp_path):
    """Rows arriving in any order land where the file holds them; each whole chunk is hashed as it is written, equal
    to the digest of the file's chunk, so the shard's checksum over them is the one computed from the file."""
    from nnterp_vllm.checksums import CHUNKED, file_checksum

    path = tmp_path / "shard"
    header, shared, region = region_in_file(path, 3, 2000, 256, start=1000)
    expected = torch.randn(3, 2000, 256, generator=torch.Generator().manual_seed(0))
    written_in_steps(region, expected, seed=1)
    region.close()
    digests = shared.chunk_digests()
    shared.close()
    assert_file_holds(path, header, expected)
    from_file = chunk_digests_from_file(path)
    assert sorted(digests) == [1, 2, 3, 4]  # the whole chunks; the first (header) and last (partial) are read
    assert all(digests[chunk] == from_file[chunk] for chunk in digests)
    assert file_checksum(path, CHUNKED, digests) == file_checksum(path, CHUNKED)


def test_rows_written_again_after_their_chunk_went_to_disk_replace_it_and_withdraw_its_digest(tmp_path):
    path = tmp_path / "shard"
    header, shared, region = region_in_file(path, 2, 2000, 256, start=512)
    expected = torch.randn(2, 2000, 256, generator=torch.Generator().manual_seed(2))
    written_in_steps(region, expected, seed=3)
    expected[:, 100:900] = -1.0
    region.put(100, expected[:, 100:900])
    region.close()
    digests = shared.chunk_digests()
    shared.close()
    assert_file_holds(path, header, expected)
    from_file = chunk_digests_from_file(path)
    assert digests and all(digests[chunk] == from_file[chunk] for chunk in digests)
    assert sorted(digests) == [1]  # value 1's rows 100..900 lie in chunk 2 (value 0's in the partial chunk 0)


def test_where_the_file_system_refuses_direct_writes_whole_chunks_go_through_the_page_cache_with_digests(
    tmp_path, monkeypatch
):
    from nnterp_vllm.engines.steered import shared_rows

    path = tmp_path / "shard"
    refused, opened = [], os.open

    def open_file(name, flags, *args):
        if flags & os.O_DIRECT:
            refused.append(name)
            raise OSError(22, "Invalid argument")
        return opened(name, flags, *args)

    monkeypatch.setattr(shared_rows.os, "open", open_file)
    header, shared, region = region_in_file(path, 3, 2000, 256, start=1000)
    expected = torch.randn(3, 2000, 256, generator=torch.Generator().manual_seed(4))
    written_in_steps(region, expected, seed=5)
    region.close()
    digests = shared.chunk_digests()
    shared.close()
    assert refused and digests
    assert_file_holds(path, header, expected)
    from_file = chunk_digests_from_file(path)
    assert all(digests[chunk] == from_file[chunk] for chunk in digests)


def test_a_chunk_failing_to_reach_the_disk_is_raised_on_the_engines_thread(tmp_path, monkeypatch):
    from nnterp_vllm.engines.steered import shared_rows

    path = tmp_path / "shard"
    header, shared, region = region_in_file(path, 3, 2000, 256, start=1000)
    write = os.pwritev

    def failing_disk(descriptor, buffers, position):
        if descriptor == region.direct:
            raise OSError(5, "Input/output error")
        return write(descriptor, buffers, position)

    monkeypatch.setattr(shared_rows.os, "pwritev", failing_disk)
    expected = torch.randn(3, 2000, 256, generator=torch.Generator().manual_seed(6))
    with pytest.raises(OSError, match="Input/output error"):
        written_in_steps(region, expected, seed=7)
        region.close()
    if any(writer.is_alive() for writer in region.writers):  # raised by a put: the region still to let go of
        with pytest.raises(OSError, match="Input/output error"):
            region.close()
    assert region.writers and not any(writer.is_alive() for writer in region.writers)
    shared.close()
