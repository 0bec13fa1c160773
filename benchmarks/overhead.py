"""What the standardized layer costs on top of nnsight, and nnsight on top of a plain forward.

For the tiny llama and SmolLM2-135M, in one run: the median time of a StandardizedTransformer
trace saving every ``layer_output``, divided by (a) a raw nnsight TransformersModel trace
saving the same native outputs and (b) a plain transformers forward with
``output_hidden_states=True``. Prints the ratios; asserts nothing.

    python benchmarks/overhead.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from nnsight import TransformersModel
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import tiny  # noqa: E402

from nnterp_vllm import StandardizedTransformer  # noqa: E402
from nnterp_vllm.checkpoints import smollm2  # noqa: E402

PROMPT = "The Eiffel Tower is in the city of Paris, which is the capital of France and"


def median_seconds(run, repeats: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, path: Path, repeats: int) -> None:
    torch.manual_seed(0)
    standardized = StandardizedTransformer(path, dispatch=True)
    raw = TransformersModel(str(path), dispatch=True, task="text-generation", attn_implementation="eager")
    plain = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    inputs = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt")
    native_blocks = raw.get(standardized._aliases["layers"])

    def run_standardized():
        saved = []
        with standardized.trace(PROMPT):
            for block in standardized.layers:
                saved.append(block.layer_output.save())
        return saved

    def run_raw():
        saved = []
        with raw.trace(PROMPT):
            for block in native_blocks:
                saved.append(block.output.save())
        return saved

    def run_plain():
        with torch.no_grad():
            return plain(**inputs, output_hidden_states=True).hidden_states

    # Interleave the three so drift in machine load hits them alike.
    rounds = {"standardized": [], "raw": [], "plain": []}
    for _ in range(3):
        rounds["standardized"].append(median_seconds(run_standardized, repeats))
        rounds["raw"].append(median_seconds(run_raw, repeats))
        rounds["plain"].append(median_seconds(run_plain, repeats))
    best = {key: min(values) for key, values in rounds.items()}
    print(
        f"{name}: standardized {best['standardized'] * 1e3:.2f} ms, raw nnsight {best['raw'] * 1e3:.2f} ms, "
        f"plain forward {best['plain'] * 1e3:.2f} ms | standardized/raw = {best['standardized'] / best['raw']:.3f}, "
        f"standardized/plain = {best['standardized'] / best['plain']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    measure("tiny llama", tiny.checkpoint("llama"), args.repeats)
    measure("SmolLM2-135M", smollm2(), args.repeats)


if __name__ == "__main__":
    main()
