"""The console script."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tiny

from nnterp_vllm.cli import main

SCRIPT = Path(sys.executable).with_name("nnterp-vllm")


def test_support_prints_the_table():
    result = subprocess.run([str(SCRIPT), "support", str(tiny.checkpoint("gpt2"))], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    table = json.loads(result.stdout)
    assert table["family"] == "gpt2" and table["layer_output"] is None and table["engine"] == "transformers"


def test_support_names_a_missing_checkpoint(tmp_path):
    result = subprocess.run([str(SCRIPT), "support", str(tmp_path / "absent")], capture_output=True, text=True)
    assert result.returncode == 2 and "absent" in result.stderr and "Traceback" not in result.stderr


def test_unknown_command_is_refused():
    result = subprocess.run([str(SCRIPT), "frobnicate"], capture_output=True, text=True)
    assert result.returncode == 2 and "invalid choice" in result.stderr


# ------------------------------------------------------------------------------------ harvest refusals


def harvest_arguments(tmp_path: Path, *extra: str, model: str | None = None) -> list[str]:
    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        corpus.write_text('{"text": "a document"}\n')
    model = model or str(tiny.checkpoint("llama"))
    return [
        "harvest",
        model,
        "--corpus",
        str(corpus),
        "--values",
        "layers.0.layer_output",
        "--out",
        str(tmp_path / "out"),
        *extra,
    ]


def refusal(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """The arguments of one refused harvest, and what its error line must say."""
    if case == "damaged-manifest":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "manifest.json").write_text('{"version": 2, "shards": {')
        return harvest_arguments(tmp_path), r"manifest\.json is damaged.*--overwrite"
    if case == "bad-corpus-line":
        (tmp_path / "corpus.jsonl").write_text('{"text": broken\n')
        return harvest_arguments(tmp_path), r"corpus\.jsonl:1: invalid JSON"
    if case == "missing-corpus":
        arguments = harvest_arguments(tmp_path)
        arguments[3] = str(tmp_path / "absent.jsonl")
        return arguments, r"absent\.jsonl: no such file"
    if case == "backwards-range":
        arguments = harvest_arguments(tmp_path)
        arguments[5] = "layers.5-2.layer_output"
        return arguments, r"'layers\.5-2\.layer_output'.*runs backwards"
    if case == "missing-model":
        return harvest_arguments(
            tmp_path, model=str(tmp_path / "no-model")
        ), r"checkpoint directory .*no-model.* does not exist"
    if case == "batch-size":
        return harvest_arguments(tmp_path, "--batch-size", "0"), "batch_size must be a positive int, got 0"
    if case == "shard-size":
        return harvest_arguments(tmp_path, "--shard-mb", "-1"), "shard_bytes must be a positive int"
    if case == "dtype":
        return harvest_arguments(tmp_path, "--dtype", "float99"), "dtype must name a torch dtype"
    if case == "model-dtype":
        return harvest_arguments(tmp_path, "--model-dtype", "half-ish"), "--model-dtype must name a torch dtype"
    if case == "context-length":
        return harvest_arguments(tmp_path, "--context-length", "0"), "context_length must be a positive int"
    if case == "pattern-without-context":
        arguments = harvest_arguments(tmp_path)
        arguments[5] = "layers.0.self_attn.attention_probabilities"
        return arguments, "needs a context length"
    if case == "sae-lens-without-context":
        return harvest_arguments(tmp_path, "--format", "sae-lens"), "format='sae-lens' .* give a context_length"
    if case == "malformed-probe":
        return harvest_arguments(tmp_path, "--probe", "toxicity=probe.safetensors"), r"--probe takes NAME=PATH"
    if case == "missing-probe-file":
        absent = tmp_path / "absent.safetensors"
        return harvest_arguments(tmp_path, "--probe", f"toxicity={absent}@0"), r"absent\.safetensors is not a readable"
    raise AssertionError(case)


REFUSALS = [
    "damaged-manifest",
    "bad-corpus-line",
    "missing-corpus",
    "backwards-range",
    "missing-model",
    "batch-size",
    "shard-size",
    "dtype",
    "model-dtype",
    "context-length",
    "pattern-without-context",
    "sae-lens-without-context",
    "malformed-probe",
    "missing-probe-file",
]


@pytest.mark.parametrize("case", REFUSALS)
def test_harvest_refusals_are_one_line_and_exit_2(case, tmp_path, capsys):
    arguments, message = refusal(tmp_path, case)
    capsys.readouterr()  # building the tiny checkpoint prints progress; only the refusal is under test
    assert main(arguments) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nnterp-vllm: error: "), lines
    assert re.search(message, lines[0]), lines[0]


@pytest.mark.parametrize("case", ["damaged-manifest", "bad-corpus-line"])
def test_the_console_script_prints_no_traceback(case, tmp_path):
    arguments, message = refusal(tmp_path, case)
    result = subprocess.run([str(SCRIPT), *arguments], capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert re.search("nnterp-vllm: error: .*" + message, result.stderr), result.stderr[-2000:]
    assert case == "damaged-manifest" or not (tmp_path / "out").exists()
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_bad_argument_type_is_argparse_usage():
    result = subprocess.run(
        [str(SCRIPT), "harvest", "m", "--corpus", "c", "--values", "v", "--out", "o", "--batch-size", "x"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "invalid int value: 'x'" in result.stderr and "Traceback" not in result.stderr
