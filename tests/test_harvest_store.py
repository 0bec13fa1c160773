"""Harvests written straight to an object store (a real S3 server, SeaweedFS, on loopback) and read back from it.

Each store harvest is checked byte for byte against the same harvest on local disk (its ground truth): every shard
object equals the local shard file, its checksum rides in the object's metadata, a resume checks each recorded
shard with one HEAD and recomputes what fails, and `load_harvest(url)` reads ranges through a bounded local
cache, every token once per epoch. The two-node Ray runs are marked ``scale`` (``pytest -m scale
tests/test_harvest_store.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import s3_server
import test_harvest
import torch
from test_harvest import documents, fails_on_the_third, write_jsonl

from nnterp_vllm import load_harvest
from nnterp_vllm.harvest import HarvestError, harvest
from nnterp_vllm.harvest import run as run_module

VALUES = ["layers.*.layer_output", "layers.1.mlp_output"]
OPTIONS = {"shard_bytes": 20_000, "progress": False}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The S3 server, its environment set for this module's clients (and the read cache's default directory in a
    temporary one, not under the home directory); a fresh prefix per test (`bucket`)."""
    with s3_server.s3_server() as server:
        environment = {**server.environment, "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache"))}
        before = {key: os.environ.get(key) for key in environment}
        os.environ.update(environment)
        try:
            yield server
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@pytest.fixture(scope="module")
def shared_bucket(store):
    return store.bucket("harvests")


@pytest.fixture
def bucket(shared_bucket, request):
    """A prefix of the module's bucket of the test's own (each bucket is a collection of volumes to the server)."""
    return f"{shared_bucket}/" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:60]


@pytest.fixture(scope="module")
def on_disk(llama_path, tmp_path_factory):
    """The ground truth: the same harvest on local disk."""
    return harvest(llama_path, documents(24, seed=3), VALUES, tmp_path_factory.mktemp("disk") / "out", **OPTIONS)


def objects(url: str) -> dict[str, bytes]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    return {path.rsplit("/", 1)[-1]: fs.cat_file(path) for path in fs.find(root)}


def assert_same_shards(url: str, local) -> None:
    stored = objects(url)
    files = [path.name for path in local.shards]
    assert len(files) > 2 and sorted(name for name in stored if name.startswith("shard-")) == files
    for path in local.shards:
        assert stored[path.name] == path.read_bytes(), path.name


def test_a_harvest_to_s3_is_the_harvest_on_disk_byte_for_byte(llama_path, on_disk, bucket, capsys):
    url = f"{bucket}/run"
    harvested = harvest(llama_path, documents(24, seed=3), VALUES, url, **OPTIONS)
    assert re.search(rf"tokens/s, [0-9.]+ MB/s written, into {url}", capsys.readouterr().out)
    assert_same_shards(url, on_disk)
    assert harvested.path == url and harvested.manifest["complete"]
    fs = harvested.location.fs
    for record in harvested.records:  # the checksum, in the manifest and in the object's metadata
        bucket_name, prefix = bucket[5:].split("/", 1)
        head = fs.call_s3("head_object", Bucket=bucket_name, Key=f"{prefix}/run/{record['file']}")
        assert head["Metadata"]["nnterp-checksum"] == f"xxh3_128:{record['xxh3_128']}"
        assert record["xxh3_128"] == on_disk.manifest["shards"][str(record["index"])]["xxh3_128"]
    assert not any(key in json.dumps(harvested.manifest) for key in ("harvest-tests", "AWS_"))  # no credentials
    harvested.verify()


def test_an_object_is_uploaded_in_parts_several_at_once_and_appears_only_whole(bucket, monkeypatch):
    """A multipart upload (parts made small here) streams the buffers in parts, several on their way at once; the
    object, with its metadata, appears once complete; an upload that fails midway is aborted: nothing appears."""
    from nnterp_vllm.harvest import location as location_module
    from nnterp_vllm.harvest.location import Location

    monkeypatch.setattr(location_module, "PART_BYTES", 5 * 2**20)  # S3's smallest part
    monkeypatch.setattr(location_module, "PARTS_AT_ONCE", 2)
    place = Location.of(f"{bucket}/objects")
    buffers = [os.urandom(3000), os.urandom(9 * 2**20), memoryview(os.urandom(3 * 2**20 + 12345))]
    place.write_parts("whole", buffers, {"nnterp-checksum": "test:1"})  # three parts, the last one short
    assert place.read_bytes("whole") == b"".join(bytes(b) for b in buffers)
    assert place.head("whole") == (12 * 2**20 + 15345, {"nnterp-checksum": "test:1"})

    def failing(views, size, spare):
        yield os.urandom(size)
        raise OSError(28, "the buffers could not be read")

    monkeypatch.setattr(location_module, "pieces", failing)
    with pytest.raises(OSError, match="could not be read"):
        place.write_parts("broken", buffers)
    assert place.head("broken") is None and not place.exists("broken")
    bucket_name, prefix = place.root.split("/", 1)
    uploads = place.fs.call_s3("list_multipart_uploads", Bucket=bucket_name, Prefix=f"{prefix}/broken")
    assert not uploads.get("Uploads")  # aborted, not left to linger


def test_a_streamed_shard_sends_each_part_once_final_and_appears_whole_with_its_checksum(bucket, monkeypatch, tmp_path):
    """A shard in memory bound for S3 sends a part as soon as the worker's table has all its chunks (not one whose
    chunks are not all there), gives back the part's memory, and appears only when finished, its bytes whole and
    its chunked checksum in its metadata; one aborted leaves no object and no upload behind."""
    from nnterp_vllm.checksums import (
        CHUNK,
        CHUNKED,
        chunk_digest,
        file_checksum,
    )
    from nnterp_vllm.harvest import streamed
    from nnterp_vllm.harvest.location import Location

    monkeypatch.setattr(streamed, "PART_BYTES", 5 * CHUNK)
    place = Location.of(f"{bucket}/streamed")
    data = os.urandom(12 * CHUNK + 4321)  # three parts, the last one short
    (tmp_path / "on-disk").write_bytes(data)
    expected = file_checksum(tmp_path / "on-disk", CHUNKED)
    table = {chunk: chunk_digest(data[chunk * CHUNK : (chunk + 1) * CHUNK]) for chunk in range(12)}

    shard = streamed.StreamedShard(place, "shard-00000.safetensors")
    os.write(shard.descriptor, data)
    shard.begin()
    shard.send_ready({chunk: table[chunk] for chunk in range(9)})  # part 0 final; part 1 lacks chunk 9
    [future.result() for future in shard.sending]
    assert len(shard.sending) == 1 and shard.unsent == {1, 2}
    assert os.fstat(shard.descriptor).st_blocks * 512 < len(data) - 4 * CHUNK  # part 0 (5 MiB) given back
    assert place.head(shard.name) is None  # nothing visible before the end
    assert shard.finish(table) == expected
    assert place.read_bytes(shard.name) == data
    assert place.head(shard.name) == (len(data), {"nnterp-checksum": f"{CHUNKED}:{expected}"})

    aborted = streamed.StreamedShard(place, "shard-00001.safetensors")
    os.write(aborted.descriptor, data)
    aborted.begin()
    aborted.send_ready(table)
    aborted.abort()
    assert place.head(aborted.name) is None
    bucket_name, prefix = place.root.split("/", 1)
    uploads = place.fs.call_s3("list_multipart_uploads", Bucket=bucket_name, Prefix=f"{prefix}/shard-00001")
    assert not uploads.get("Uploads")


def test_a_resume_heads_each_shard_and_recomputes_what_fails(llama_path, on_disk, bucket, monkeypatch):
    """Killed after two shards (a forward fails), the rerun finishes the rest; a shard removed from the store, one
    replaced by other bytes and one whose metadata lost its checksum are found with a HEAD each and recomputed."""
    url, docs = f"{bucket}/run", documents(24, seed=3)
    compute, computed = run_module.compute, []
    monkeypatch.setattr(run_module, "compute", fails_on_the_third(compute, computed))
    with pytest.raises(RuntimeError, match="the forward failed"):
        harvest(llama_path, docs, VALUES, url, **OPTIONS)
    monkeypatch.setattr(run_module, "compute", lambda m, u, j: computed.append(u.index) or compute(m, u, j))
    computed.clear()
    done = harvest(llama_path, docs, VALUES, url, **OPTIONS)
    assert computed == list(range(2, len(on_disk.shards)))
    assert_same_shards(url, on_disk)
    fs, root = done.location.fs, done.location.root
    fs.rm_file(f"{root}/shard-00000.safetensors")
    fs.pipe_file(f"{root}/shard-00001.safetensors", b"other bytes")
    data = fs.cat_file(f"{root}/shard-00002.safetensors")
    fs.pipe_file(f"{root}/shard-00002.safetensors", data)  # the same bytes, no checksum in its metadata
    computed.clear()
    harvest(llama_path, docs, VALUES, url, **OPTIONS)
    assert computed == [0, 1, 2]
    assert_same_shards(url, on_disk)


def test_batches_from_the_store_read_ranges_through_a_bounded_cache(llama_path, on_disk, bucket, tmp_path):
    url = f"{bucket}/run"
    harvest(llama_path, documents(24, seed=3), VALUES, url, **OPTIONS)
    total = sum(record["bytes"] for record in on_disk.records)
    from nnterp_vllm.harvest import cache as cache_module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cache_module, "BLOCK", 4096)
        remote = load_harvest(url, cache_dir=tmp_path / "cache", cache_bytes=64 * 1024)
        for shuffle in (False, True):
            seen = torch.cat([batch["token_ids"] for batch in remote.batches(7, shuffle=shuffle, values=["token_ids"])])
            assert sorted(seen.tolist()) == sorted(on_disk.load("token_ids").tolist())  # every token once
        assert remote.cache.fetched < total / 3  # the one column asked for, not whole shards
        name = "layers.2.layer_output"
        want = {int(t): v for t, v in zip(torch.arange(len(on_disk)), on_disk.load(name))}
        for batch in remote.batches(5, shuffle=True, seed=1, values=[name, "token_ids", "rows", "documents"]):
            assert batch[name].shape[1:] == want[0].shape
        for name in on_disk.values:
            assert torch.equal(remote.load(name), on_disk.load(name))
        blocks = list((tmp_path / "cache").glob("*.block"))
        assert sum(path.stat().st_size for path in blocks) <= 64 * 1024 + 3 * 4096  # the bound, and one read's own
    copy = remote.download(tmp_path / "copy")
    assert [path.read_bytes() for path in copy.shards] == [path.read_bytes() for path in on_disk.shards]


def test_a_sae_lens_harvest_on_the_store_is_the_dataset_datasets_reads(llama_path, bucket, tmp_path, store):
    import datasets

    options = {"format": "sae-lens", "context_length": 16, "dtype": "float32", **OPTIONS}
    local = harvest(llama_path, documents(30, seed=2), ["layers.1.layer_output"], tmp_path / "local", **options)
    url = f"{bucket}/sae"
    remote = harvest(llama_path, documents(30, seed=2), ["layers.1.layer_output"], url, **options)
    stored = objects(url)
    for path in local.shards:
        assert stored[path.name] == path.read_bytes()
    assert torch.equal(remote.load("layers.1.layer_output"), local.load("layers.1.layer_output"))
    options = {"endpoint_url": store.endpoint, "key": "any", "secret": "any"}
    from_store = datasets.load_from_disk(url, storage_options=options)
    from_disk = datasets.load_from_disk(str(tmp_path / "local"))
    assert from_store.column_names == from_disk.column_names and len(from_store) == len(from_disk) > 1
    column = local.manifest["values"]["layers.1.layer_output"]["column"]
    assert from_store[:][column] == from_disk[:][column]


#: SAELens's trainer, given the harvests by URL: it reads batches straight from the store, and trains from the
#: sae-lens layout copied down (SAELens checks ``os.path.exists(cached_activations_path)`` before ``datasets`` reads).
STORE_TRAINER = (
    """
import sys
from nnterp_vllm import load_harvest
sys.argv[2] = str(load_harvest(sys.argv[2]).download(sys.argv[5]).path)
"""
    + test_harvest.TRAINER_SCRIPT
)


def test_saelens_trains_from_a_harvest_on_the_store(llama_path, bucket, tmp_path):
    """The trainer's environment (no nnsight, no vLLM imported) reads the safetensors harvest's batches from the
    store and SAELens's own runner trains an SAE from the sae-lens harvest on the store, as from disk."""
    values = ["layers.1.layer_output", "layers.2.mlp_output"]
    options = {"context_length": 32, "shard_bytes": 40_000, "progress": False, "overflow": "pack"}
    harvest(llama_path, documents(16, seed=7), values, f"{bucket}/default", **options)
    harvest(llama_path, documents(16, seed=7), values, f"{bucket}/sae-lens", format="sae-lens", **options)
    (tmp_path / "text").mkdir()
    write_jsonl(tmp_path / "text" / "train.jsonl", documents(4))
    arguments = [f"{bucket}/default", f"{bucket}/sae-lens", tmp_path / "text", str(llama_path), tmp_path / "copy"]
    result = subprocess.run(
        [sys.executable, "-c", STORE_TRAINER, *map(str, arguments)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["loaded"] == []
    assert report["after"] < report["before"] / 4, report


def test_a_vllm_harvest_in_the_engine_to_s3_is_the_one_on_disk(llama_path, bucket, tmp_path, monkeypatch):
    """The shards the engine's worker fills in memory are the ones it fills on disk, byte for byte; one of several
    parts (5 MiB, S3's least) is sent part by part while its requests run, each part's memory given back once sent, and
    lands whole with its checksum in its metadata (a resume's HEAD finds it good)."""
    from nnterp_vllm import SteeredVLLM
    from nnterp_vllm.harvest import streamed
    from nnterp_vllm.harvest.store import shard_problem

    monkeypatch.setattr(streamed, "PART_BYTES", 5 * 2**20)
    finishing, finish = [], streamed.StreamedShard.finish

    def counted_finish(shard, final):
        if shard.created is not None:  # parts sent during the engine's steps; the memory file's bytes still held
            for part in shard.sending:  # a part's memory is given back once it is sent, which takes its own time
                part.result()
            unsent = sum(shard._part_size(part) for part in shard.unsent)
            finishing.append((len(shard.sending), os.fstat(shard.descriptor).st_blocks * 512, unsent))
        return finish(shard, final)

    monkeypatch.setattr(streamed.StreamedShard, "finish", counted_finish)
    big = {"shard_bytes": 12 * 2**20, "progress": False}
    engine = SteeredVLLM(llama_path, dtype="float32", capture_values=VALUES, enable_prefix_caching=False)
    try:
        local = harvest(engine, documents(24, seed=3), VALUES, tmp_path / "local", **OPTIONS)
        url = f"{bucket}/vllm"
        remote = harvest(engine, documents(24, seed=3), VALUES, url, **OPTIONS)
        local_big = harvest(engine, documents(2000, seed=5), ["layers.1.layer_output"], tmp_path / "big", **big)
        remote_big = harvest(engine, documents(2000, seed=5), ["layers.1.layer_output"], f"{bucket}/big", **big)
    finally:
        engine.shutdown()
    assert remote.manifest["vllm_path"] == "engine"
    assert_same_shards(url, local)
    assert_same_shards(f"{bucket}/big", local_big)
    # Which parts are final before a shard's last step depends on when the worker's writer threads mark their chunks,
    # so not every shard need have sent one early; each sent part's memory is given back, whatever the timing.
    assert any(sent for sent, _, _ in finishing), finishing
    assert all(held <= unsent + 2**16 for _, held, unsent in finishing), finishing
    assert all(shard_problem(remote_big.location, record) is None for record in remote_big.records)


@pytest.mark.parametrize(
    "out, options, message",
    [
        ("nosuch://bucket/run", None, r"'nosuch://bucket/run'.*fsspec serves"),
        ("local-directory", {"key": "x"}, r"storage_options are for a URL"),
    ],
    ids=["unknown-protocol", "options-for-a-path"],
)
def test_an_output_no_store_serves_is_refused_before_any_work(llama_path, tmp_path, out, options, message):
    with pytest.raises(ValueError, match=message):
        harvest(llama_path, ["a b"], VALUES, out, storage_options=options, progress=False)
    assert not Path("local-directory").exists()


def test_a_shard_missing_from_a_declared_shared_file_system_stops_the_harvest(tmp_path):
    """With --shared-filesystem, the driver checks each shard a replica reports where it reads it: one that is not
    there (the path was not shared after all), or not whole, stops the harvest naming it and both fixes."""
    from nnterp_vllm.harvest.fanout import _checked
    from nnterp_vllm.harvest.location import Location

    recorded = []
    check = _checked(Location.of(tmp_path), lambda index, record: recorded.append(index))
    (tmp_path / "shard-00000.safetensors").write_bytes(b"12345")
    check(0, {"file": "shard-00000.safetensors", "bytes": 5})
    with pytest.raises(HarvestError, match=r"shard-00001.safetensors .* is missing on this machine.*s3://"):
        check(1, {"file": "shard-00001.safetensors", "bytes": 5})
    with pytest.raises(HarvestError, match=r"holds 5 bytes, not 9 on this machine: --out is not a file system every"):
        check(0, {"file": "shard-00000.safetensors", "bytes": 9})
    assert recorded == [0]


def test_a_missing_bucket_is_refused_before_the_model_loads(llama_path, store, monkeypatch):
    monkeypatch.setattr(run_module, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(OSError, match=r"the bucket s3://no-such-bucket of --out .* does not exist.*create it"):
        harvest(llama_path, ["a b"], VALUES, "s3://no-such-bucket/run", progress=False)


def test_the_plan_prints_bytes_per_token_the_run_size_and_the_bandwidth(llama_path, on_disk, tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", documents(24, seed=3))
    command = [sys.executable, "-m", "nnterp_vllm.cli", "harvest", str(llama_path), "--corpus", str(corpus)]
    command += ["--values", *VALUES, "--out", str(tmp_path / "never"), "--plan", "--tokens-per-second", "1000"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    per_token = sum(record["bytes"] for record in on_disk.records)  # header bytes aside: the shards' own bytes
    tokens = len(on_disk)
    values = 4 * 128 * 4  # four [128] float32 values
    assert f"bytes per token: {values + 32:,} ({values:,} of values, 32 of token metadata)" in run.stdout
    assert f"the run: {tokens:,} tokens kept from 24 documents" in run.stdout
    assert f"the store must take {1000 * (values + 32) / 1e6:,.1f} MB/s" in run.stdout
    assert per_token >= tokens * (values + 32) and not (tmp_path / "never").exists()


# -- two Ray nodes standing in for two machines ---------------------------------------------------------------


@pytest.fixture(scope="module")
def two_nodes(store, tmp_path_factory):
    """A Ray cluster of two nodes (one CPU each) on loopback, each started in a working and temporary directory of
    its own with the store's environment; its address and those directories. Stopped by PID."""
    import shutil
    import tempfile

    from test_scale import RAY, clean_env, free_port, stop_processes_of

    directories = [Path(tempfile.mkdtemp(prefix="nnterp-node-")) for _ in range(2)]
    port = free_port()
    try:
        for number, directory in enumerate(directories):
            role = ["--head", "--port", str(port), "--include-dashboard", "false"] if number == 0 else []
            role += ["--temp-dir", str(directory)] if number == 0 else ["--address", f"127.0.0.1:{port}"]
            env = clean_env(RAY_AUTH_MODE="disabled", RAY_TMPDIR=str(directory), TMPDIR=str(directory))
            run = subprocess.run(
                [RAY, "start", "--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats", *role],
                env={**env, **store.environment},
                cwd=directory,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        yield f"127.0.0.1:{port}", directories
    finally:
        stop_processes_of(directories)
        for directory in directories:
            shutil.rmtree(directory, ignore_errors=True)


def command_line(llama_path: Path, corpus: Path, out: str, engine: str, *more: str) -> list[str]:
    command = [sys.executable, "-m", "nnterp_vllm.cli", "harvest", str(llama_path), "--corpus", str(corpus)]
    command += ["--engine", engine, "--values", "layers.*.layer_output", "--model-dtype", "float32"]
    return [*command, "--shard-mb", "0.02", "--quiet", "--out", out, *more]


@pytest.mark.scale
def test_two_nodes_harvest_straight_to_s3_as_one_local_worker_does(two_nodes, bucket, llama_path, tmp_path, store):
    """``--workers 2`` on two Ray nodes, each replica writing only through the store: on both engines every shard
    object equals a single local worker's file; a vLLM run killed mid-way and rerun ends the same; a local --out
    is refused before any work (both fixes named); the nodes' own directories hold no shard."""
    import signal
    import time

    import fsspec
    from test_scale import clean_env

    address, directories = two_nodes
    corpus = write_jsonl(tmp_path / "corpus.jsonl", documents(40, seed=4))
    env = clean_env(**store.environment)
    workers = ["--workers", "2", "--ray-address", address]
    for engine in ("hf", "vllm"):
        one = subprocess.run(command_line(llama_path, corpus, str(tmp_path / engine), engine), env=env, timeout=900)
        assert one.returncode == 0
        url = f"{bucket}/{engine}"
        if engine == "vllm":  # killed once a shard landed, then rerun
            process = subprocess.Popen(command_line(llama_path, corpus, url, engine, *workers), env=env)
            fs, root = fsspec.core.url_to_fs(url)
            deadline = time.monotonic() + 600
            while (
                not fs.exists(f"{root}/manifest.json") or not json.loads(fs.cat_file(f"{root}/manifest.json"))["shards"]
            ):
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.5)
                fs.invalidate_cache()
            process.send_signal(signal.SIGKILL)
            process.wait()
        run = subprocess.run(command_line(llama_path, corpus, url, engine, *workers), env=env, timeout=900)
        assert run.returncode == 0
        local = load_harvest(tmp_path / engine)
        assert_same_shards(url, local)
        remote = load_harvest(url, cache_dir=tmp_path / f"cache-{engine}")
        seen = torch.cat([batch["token_ids"] for batch in remote.batches(16, values=["token_ids"])])
        assert sorted(seen.tolist()) == sorted(local.load("token_ids").tolist())
    refused = subprocess.run(
        command_line(llama_path, corpus, str(tmp_path / "local"), "vllm", *workers),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert refused.returncode == 2 and "--shared-filesystem" in refused.stderr and "s3://" in refused.stderr
    assert not (tmp_path / "local").exists()
    for directory in directories:
        assert not [path for path in directory.rglob("shard-*")], directory
