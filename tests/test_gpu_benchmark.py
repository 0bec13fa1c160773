"""benchmarks/gpu.py skips its vLLM half, saying why, where there is no CUDA (its torch half runs in about 40 s
here, mostly imports: run it by hand with ``--only torch --small --rounds 1``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the vLLM half runs")
def test_the_vllm_half_is_skipped_without_cuda() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--only", "vllm"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    reason = "CUDA is not available (the vLLM half runs vLLM's CUDA build on a GPU)"
    assert done.stdout.strip() == f"skipped the vllm half: {reason}"
