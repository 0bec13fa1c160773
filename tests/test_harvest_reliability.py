"""Harvest reliability: every bad input or damaged directory is refused by name before work, nothing is lost.

Resume cases end byte-identical to an uninterrupted run; refusals leave the directory as it
was (or, for a new one, create nothing) and load no model when the input alone is wrong.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import test_harvest
from test_harvest import write_jsonl

from nnterp_vllm import load_harvest
from nnterp_vllm.harvest import HarvestError, harvest
from nnterp_vllm.harvest import run as run_module
from nnterp_vllm.harvest.corpus import CorpusError
from nnterp_vllm.harvest.store import staging

VALUES = ["layers.*.layer_output"]
# The tiny llama's module-scoped fixture, shared with the harvest tests (``llama_path`` is conftest's).
llama = test_harvest.llama
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards hex bold jumping zebras".split()


def corpus_lines(count: int) -> list[str]:
    """``count`` documents, each starting with its number (``"007 ..."``), one in seven empty."""
    return [
        "" if i % 7 == 3 else f"{i:03d} " + " ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(4 + i % 9))
        for i in range(count)
    ]


def snapshot(out: Path) -> dict[str, bytes]:
    """Every file in ``out``, by name, with its bytes."""
    return {path.name: path.read_bytes() for path in sorted(out.iterdir())}


def run(model, corpus, out, **kwargs):
    kwargs = {"context_length": 32, "shard_bytes": 60_000, "progress": False, **kwargs}
    return harvest(model, corpus, kwargs.pop("values", VALUES), out, **kwargs)


@pytest.fixture(scope="module")
def reference(llama, tmp_path_factory):
    """An uninterrupted harvest of a corpus file, and that file: what every resume must reproduce."""
    scratch = tmp_path_factory.mktemp("reference")
    corpus = write_jsonl(scratch / "corpus.jsonl", corpus_lines(24))
    out = scratch / "out"
    result = run(llama, corpus, out)
    assert len(result.shards) >= 4 and result.manifest["complete"]
    return corpus, out, snapshot(out)


@pytest.fixture
def copy(reference, tmp_path):
    corpus, out, files = reference
    target = tmp_path / "out"
    shutil.copytree(out, target)
    return corpus, target, files


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded for an input that is wrong on its own")

    monkeypatch.setattr(run_module, "load_model", refuse)


# ------------------------------------------------------------------------------------ damaged shards


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda path: path.unlink(), "missing"),
        (lambda path: path.write_bytes(path.read_bytes()[:-100]), "truncated"),
        (lambda path: path.write_bytes(path.read_bytes()[:-8] + b"\xff" * 8), "damaged"),
    ],
    ids=["deleted", "truncated", "same-size-corrupted"],
)
def test_a_bad_shard_is_recomputed(llama, copy, caplog, damage, problem):
    corpus, out, files = copy
    damage(out / "shard-00002.safetensors")
    with caplog.at_level(logging.WARNING, logger="nnterp_vllm.harvest"):
        run(llama, corpus, out)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and "shard-00002.safetensors" in lines[0] and problem in lines[0], lines
    assert "recomputing" in lines[0]
    assert snapshot(out) == files


def test_leftover_temporary_files_are_removed_and_names_are_per_process(llama, copy):
    corpus, out, files = copy
    (out / "shard-00001.safetensors.99999-0badc0de.tmp").write_bytes(b"half a shard")
    (out / "manifest.json.99999-0badc0de.tmp").write_text("{")
    run(llama, corpus, out)
    assert snapshot(out) == files
    names = {staging(out / "manifest.json").name for _ in range(2)}
    assert len(names) == 2 and all(f".{os.getpid()}-" in name for name in names)


def test_missing_or_truncated_shard_is_named_when_read(copy):
    _, out, files = copy
    (out / "shard-00001.safetensors").unlink()
    loaded = load_harvest(out)
    with pytest.raises(HarvestError, match=r"shard-00001\.safetensors.*missing.*rerun"):
        loaded.verify()
    with pytest.raises(HarvestError, match=r"cannot read shard-00001\.safetensors.*rerun"):
        loaded.load("token_ids")
    (out / "shard-00001.safetensors").write_bytes(files["shard-00001.safetensors"][:50])
    with pytest.raises(HarvestError, match=r"shard-00001\.safetensors.*truncated: 50 bytes"):
        load_harvest(out).verify()
    whole = files["shard-00001.safetensors"]
    (out / "shard-00001.safetensors").write_bytes(whole[: 8 + int.from_bytes(whole[:8], "little") + 100])
    for shuffle in (False, True):  # the header intact, the rows cut short: named by both reads
        with pytest.raises(
            HarvestError, match=r"cannot read shard-00001\.safetensors in .*ends \d+ bytes short.*rerun"
        ):
            list(load_harvest(out).batches(4, shuffle=shuffle))


# ------------------------------------------------------------------------------------ the manifest


@pytest.mark.parametrize(
    "content, message",
    [
        (lambda text: text[: len(text) // 2], r"manifest\.json is damaged \(.*: line \d+, column \d+\)"),
        (lambda text: "[]", r"manifest\.json is damaged \(not a harvest manifest"),
        (lambda text: text.replace('"xxh3_128"', '"xxh"'), r"manifest\.json is damaged \(the record of shard"),
    ],
    ids=["truncated", "not-a-manifest", "record-lacks-a-key"],
)
def test_a_damaged_manifest_is_named_with_the_fix(llama, copy, no_model_load, content, message):
    """With no shard to rebuild it from (each carries its own record), a damaged manifest is refused, naming it."""
    corpus, out, files = copy
    for shard in out.glob("shard-*"):
        shard.unlink()
    manifest = out / "manifest.json"
    manifest.write_text(content(manifest.read_text()))
    before = snapshot(out)
    with pytest.raises(HarvestError, match=message + r".*--overwrite"):
        run(llama, corpus, out)
    with pytest.raises(HarvestError, match=message):
        load_harvest(out)
    assert snapshot(out) == before


def test_a_truncated_manifest_is_rebuilt_from_the_shards_own_records(llama, copy, monkeypatch, caplog):
    """A manifest cut short (a crash of a disk that had not written it) is rebuilt, without --overwrite, from the
    records each shard carries of itself: the rerun computes no shard again and ends with the same files."""
    corpus, out, files = copy
    manifest = out / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[: len(manifest.read_bytes()) // 3])
    computed = []
    compute = run_module.compute
    monkeypatch.setattr(run_module, "compute", lambda *args: computed.append(1) or compute(*args))
    with caplog.at_level(logging.WARNING, logger="nnterp_vllm.harvest"):
        rebuilt = run(llama, corpus, out)
    assert "rebuilt it from the" in caplog.text and computed == []
    assert rebuilt.manifest["complete"] and len(rebuilt.shards) == len([n for n in files if n.startswith("shard-")])
    assert {name: data for name, data in snapshot(out).items() if name != "manifest.json"} == {
        name: data for name, data in files.items() if name != "manifest.json"
    }
    recorded = sorted(json.loads(files["manifest.json"])["shards"].values(), key=lambda r: r["index"])
    assert [(r["file"], r["tokens"], r["corpus_sha256"]) for r in rebuilt.records] == [
        (r["file"], r["tokens"], r["corpus_sha256"]) for r in recorded
    ]
    rebuilt.verify()


def test_shards_of_other_settings_are_not_adopted_into_a_lost_manifest(llama, copy):
    corpus, out, _ = copy
    (out / "manifest.json").unlink()
    with pytest.raises(HarvestError, match="holds shards made with other settings.*--overwrite"):
        run(llama, corpus, out, dtype="float16")


def test_every_shard_and_manifest_is_fsynced_before_its_rename_and_its_directory_after(llama, reference, tmp_path):
    """Counts the fsyncs of a harvest: each shard's and each manifest's temporary file once, before it is renamed
    (so a power loss never leaves a renamed file empty or torn), and the directory after each rename."""
    corpus, _, files = reference
    out = tmp_path / "out"
    synced: list[str] = []
    real = os.fsync

    def fsync(descriptor):
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        return real(descriptor)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fsync", fsync)
        result = run(llama, corpus, out)
    shards = [path.name for path in result.shards]
    for name in shards:
        pattern = rf"{re.escape(str(out / name))}\.\d+-[0-9a-f]+\.tmp"
        temporary = [path for path in synced if re.fullmatch(pattern, path)]
        assert len(temporary) == 1, (name, synced)
    manifests = [path for path in synced if path.startswith(str(out / "manifest.json."))]
    assert len(manifests) == len(shards) + 1  # rewritten after every shard, and when the harvest is complete
    assert synced.count(str(out)) == len(shards) + len(manifests)  # after each rename
    assert {name: data for name, data in snapshot(out).items()} == files


def test_overwrite_replaces_a_damaged_manifest(llama, copy):
    corpus, out, files = copy
    (out / "manifest.json").write_text('{"version": 2, "shards": {')
    run(llama, corpus, out, overwrite=True)
    assert snapshot(out) == files


def test_a_manifest_of_the_older_layout_is_refused_for_resuming(llama, copy):
    corpus, out, _ = copy
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["version"]
    manifest["format"] = 1  # version 1 spelled its version so
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(HarvestError, match=r"older nnterp_vllm \(layout version 1\).*--overwrite"):
        run(llama, corpus, out)
    assert len(load_harvest(out)) > 0  # still readable


def test_a_harvest_with_sha256_checksums_resumes_checking_them(llama, copy, caplog):
    """A version-2 directory records sha256 checksums: a resume checks its shards by them (a damaged one
    is recomputed), records new shards with xxh3-128, and ends as the same files as a new run."""
    corpus, out, files = copy
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["version"], manifest["complete"] = 2, False
    for record in manifest["shards"].values():
        del record["xxh3_128"]
        record["sha256"] = hashlib.sha256((out / record["file"]).read_bytes()).hexdigest()
    del manifest["shards"]["3"]
    (out / "shard-00003.safetensors").unlink()
    (out / "manifest.json").write_text(json.dumps(manifest))
    damaged = out / "shard-00001.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-8] + b"\xff" * 8)
    assert len(load_harvest(out)) > 0
    with caplog.at_level(logging.WARNING, logger="nnterp_vllm.harvest"):
        run(llama, corpus, out)
    assert [record.getMessage() for record in caplog.records if "shard-00001" in record.getMessage()]
    resumed = load_harvest(out)
    assert resumed.manifest["version"] == 3 and resumed.manifest["complete"]
    checksums = [next(key for key in ("sha256", "xxh3_128") if key in record) for record in resumed.records]
    assert checksums[0] == "sha256" and checksums[1] == checksums[3] == "xxh3_128"
    resumed.verify()
    assert {name: data for name, data in snapshot(out).items() if name.endswith(".safetensors")} == {
        name: data for name, data in files.items() if name.endswith(".safetensors")
    }


# ------------------------------------------------------------------------------------ the corpus


def test_a_corpus_edited_in_place_to_the_same_size_is_refused(llama, reference, tmp_path):
    original, _, _ = reference
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(original, corpus)
    out = tmp_path / "out"
    run(llama, corpus, out)
    before = snapshot(out)
    text = corpus.read_text()
    corpus.write_text(text.replace('"text": "015 ', '"text": "0x5 '))
    assert corpus.stat().st_size == len(text.encode())
    with pytest.raises(HarvestError, match=r"corpus is not the one.*--overwrite") as error:
        run(llama, corpus, out)
    first, last = map(int, re.search(r"documents (\d+) to (\d+)\) differs", str(error.value)).groups())
    assert first <= 15 <= last
    assert snapshot(out) == before
    run(llama, corpus, out, overwrite=True)
    fresh = tmp_path / "fresh"
    run(llama, corpus, fresh)
    assert snapshot(out) == snapshot(fresh)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda lines: [*lines, "024 one more document at the end"], "more than the|differs"),
        (lambda lines: lines[:-6], "ends before|differs"),
        (lambda lines: [*lines, ""], "differ"),
    ],
    ids=["appended", "shortened", "empty-document-appended"],
)
def test_a_grown_or_shortened_corpus_is_refused(llama, reference, tmp_path, edit, message):
    _, out, files = reference
    corpus = write_jsonl(tmp_path / "corpus.jsonl", edit(corpus_lines(24)))
    target = tmp_path / "out"
    shutil.copytree(out, target)
    manifest = json.loads((target / "manifest.json").read_text())
    before = snapshot(target)
    with pytest.raises(HarvestError, match=f"corpus is not the one.*({message})"):
        run(llama, corpus, target)
    assert snapshot(target) == before and len(manifest["shards"]) >= 4


def test_an_edited_in_memory_corpus_is_refused(llama, tmp_path):
    lines = corpus_lines(10)
    out = tmp_path / "out"
    run(llama, lines, out)
    with pytest.raises(HarvestError, match="corpus is not the one.*in-memory list"):
        run(llama, [*lines[:4], "004 changed", *lines[5:]], out)


def test_a_generator_is_read_once_and_harvested_whole(llama, reference, tmp_path):
    _, out, files = reference
    lines = corpus_lines(24)
    streamed = run(llama, (line for line in lines), tmp_path / "gen")
    streamed_files = snapshot(tmp_path / "gen")
    assert {name: data for name, data in streamed_files.items() if name.startswith("shard-")} == {
        name: data for name, data in files.items() if name.startswith("shard-")
    }
    assert streamed.manifest["stats"] == json.loads(files["manifest.json"])["stats"]
    run(llama, iter(lines), tmp_path / "gen")  # a rerun with a new generator: nothing to do
    assert snapshot(tmp_path / "gen") == streamed_files


def test_a_generator_cannot_prove_shards_after_a_gap(llama, tmp_path):
    lines = corpus_lines(24)
    out = tmp_path / "out"
    run(llama, iter(lines), out)
    files = snapshot(out)
    (out / "shard-00001.safetensors").unlink()
    before = snapshot(out)
    with pytest.raises(HarvestError, match="shards to compute before shards already recorded.*one-shot"):
        run(llama, iter(lines), out)
    assert snapshot(out) == before
    run(llama, lines, out)  # a list can be read twice: the gap is filled
    assert snapshot(out) == files


# ------------------------------------------------------------------------------------ refused before any work


@pytest.mark.parametrize(
    "values, error, message",
    [
        (["layers.5-2.layer_output"], ValueError, r"'layers\.5-2\.layer_output'.*runs backwards; write '2-5'"),
        (["layers..layer_output"], ValueError, r"'layers\.\.layer_output'.*layer part ''"),
        (["layers.1,,2.layer_output"], ValueError, r"layer part '1,,2'"),
        (["layers.-1.layer_output"], ValueError, r"layer part '-1'"),
        (["layers.x.layer_output"], ValueError, r"layer part 'x'"),
        (["layers.3"], ValueError, r"unknown value 'layers\.3'.*layers\.<i>\.layer_output"),
        (["layers.1.layer_outptu"], ValueError, r"unknown value 'layers\.1\.layer_outptu'"),
        (["final_norm_output", 7], TypeError, r"selector string.*not 7"),
        ([], ValueError, "no values to harvest"),
        (["layers.0.self_attn.attention_scores"], ValueError, "needs a context length"),
    ],
)
def test_malformed_selectors_are_refused_before_the_model_loads(
    llama_path, tmp_path, no_model_load, values, error, message
):
    with pytest.raises(error, match=message):
        harvest(llama_path, ["a document"], values, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_layer_beyond_the_model_creates_nothing(llama, tmp_path):
    with pytest.raises(ValueError, match=r"'layers\.2-9\.layer_output': layer\(s\) \[3, 4, 5, 6, 7, 8, 9\]"):
        harvest(llama, ["a document"], ["layers.2-9.layer_output"], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "corpus, message",
    [
        ("missing.jsonl", "missing.jsonl: no such file"),
        ("corpus.csv", r"corpus.csv: unsupported file type '\.csv'"),
        ("wrong-field.jsonl", r"wrong-field.jsonl:1: expected a 'text' \(string\) or 'input_ids'"),
        ("empty.jsonl", "empty.jsonl: holds no documents"),
        (42, "cannot read a corpus from a int"),
        ({"text": "a"}, "cannot read a corpus from a dict"),
        ([], "in-memory list: holds no documents"),
    ],
)
def test_bad_corpora_are_refused_before_the_model_loads(llama_path, tmp_path, no_model_load, corpus, message):
    (tmp_path / "corpus.csv").write_text("text\n")
    (tmp_path / "wrong-field.jsonl").write_text('{"body": "a"}\n')
    (tmp_path / "empty.jsonl").write_text("")
    if isinstance(corpus, str):
        corpus = tmp_path / corpus
    with pytest.raises(CorpusError, match=message):
        harvest(llama_path, corpus, VALUES, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"batch_size": 0}, ValueError, "batch_size must be a positive int, got 0"),
        ({"workers": 0}, ValueError, "workers must be a positive int, got 0"),
        ({"shard_bytes": -5}, ValueError, "shard_bytes must be a positive int, got -5"),
        ({"dtype": "float99"}, ValueError, "dtype must name a torch dtype.*'float99'"),
        ({"positions": "middle"}, ValueError, "positions must be 'all', 'last'.*'middle'"),
        ({"engine": "onnx"}, ValueError, "unknown engine 'onnx'"),
        ({"context_length": 0}, ValueError, "context_length must be a positive int"),
        ({"overflow": "wrap"}, ValueError, "overflow must be one of.*'wrap'"),
        ({"model_kwargs": "float16"}, TypeError, "model_kwargs must be a dict"),
        ({"model": 123}, TypeError, "model must be a checkpoint directory.*not a int"),
        ({"out": None}, TypeError, r"out must be a directory path or a URL \(s3://bucket/run, ...\), not None"),
    ],
)
def test_bad_arguments_are_refused_before_the_model_loads(llama_path, tmp_path, no_model_load, kwargs, error, message):
    arguments = {"model": llama_path, "corpus": ["a document"], "values": VALUES, "out": tmp_path / "out"}
    arguments.update({key: kwargs.pop(key) for key in ("model", "out") if key in kwargs})
    with pytest.raises(error, match=message):
        harvest(**arguments, progress=False, **kwargs)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ one writer at a time

HOLD_LOCK = """
import fcntl, os, sys
handle = open(sys.argv[1], "a+")
fcntl.flock(handle, fcntl.LOCK_EX)
handle.write(str(os.getpid())); handle.flush()
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_second_writer_is_refused(llama, copy):
    corpus, out, files = copy
    (out / "shard-00002.safetensors").unlink()  # work the refused run would do
    before = snapshot(out)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out / ".lock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(HarvestError, match=rf"another harvest \(process {holder.pid}\) is writing into .*out"):
            run(llama, corpus, out)
        assert {name: data for name, data in snapshot(out).items() if name != ".lock"} == {
            name: data for name, data in before.items() if name != ".lock"
        }
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    run(llama, corpus, out)
    assert snapshot(out) == files
