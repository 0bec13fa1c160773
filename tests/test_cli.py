"""The console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import tiny

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
