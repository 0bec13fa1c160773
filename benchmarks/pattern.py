"""The cost of reading the attention pattern, on SmolLM2-135M (fp32, CPU), on both engines, in one run.

A batch of prompts of a fixed length (one invoke each on vLLM, one batch on transformers) traced three ways:
reading the last block's ``layer_output`` only (the baseline), that and one block's
``attention_probabilities``, and that and every block's. Transformers runs eager attention (the only one that
exposes the pattern) for all three. The three run in alternating rounds; each ratio is the median of the
rounds' ratios of the trace's time to the baseline's. Prints times and ratios; asserts nothing.

    python benchmarks/pattern.py [--prompts 16] [--length 256] [--rounds 3] [--engines vllm,transformers]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

READS = ("baseline", "one block", "every block")


def token_prompts(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """``count`` distinct prompts of exactly ``length`` token ids, cut from the shipped corpus."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "nnterp_vllm" / "data" / "corpus.jsonl").read_text()
    ids = tokenizer(text)["input_ids"]
    return [ids[i * 37 : i * 37 + length] for i in range(count)]


def trace(model: Any, prompts: list[list[int]], read: str) -> None:
    """One trace of ``prompts`` reading what ``read`` names (`READS`)."""
    import torch

    saved = []
    blocks = {"baseline": [], "one block": [model.num_layers // 2], "every block": range(model.num_layers)}[read]
    if model.ENGINE == "vllm":
        with model.trace() as tracer:
            for prompt in prompts:
                with tracer.invoke(prompt):  # in the order the forward computes them
                    saved.extend(model.layers[i].self_attn.attention_probabilities.save() for i in blocks)
                    saved.append(model.layers[-1].layer_output.save())
    else:
        with torch.no_grad(), model.trace(torch.tensor(prompts)):
            saved.extend(model.layers[i].self_attn.attention_probabilities.save() for i in blocks)
            saved.append(model.layers[-1].layer_output.save())


def timed(run: Callable[[], None]) -> float:
    began = time.perf_counter()
    run()
    return time.perf_counter() - began


def measure(engine: str, count: int, length: int, rounds: int) -> dict[str, list[float]]:
    from nnterp_vllm.checkpoints import smollm2

    path = str(smollm2())
    if engine == "vllm":
        from nnterp_vllm import StandardizedVLLM

        model = StandardizedVLLM(path, dtype="float32", dispatch=True, max_model_len=2 * length)
    else:
        from nnterp_vllm import StandardizedTransformer

        model = StandardizedTransformer(path, dtype="float32", attn_implementation="eager")
    try:
        prompts = token_prompts(model.tokenizer, count, length)
        for read in READS:  # warm-up: compiles, fills caches
            trace(model, prompts, read)
        times: dict[str, list[float]] = {read: [] for read in READS}
        for _ in range(rounds):
            for read in READS:
                times[read].append(timed(lambda read=read: trace(model, prompts, read)))
        return times
    finally:
        if engine == "vllm":
            model.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default="vllm,transformers", type=lambda text: text.split(","))
    args = parser.parse_args()
    print(f"SmolLM2-135M fp32, {args.prompts} prompts of {args.length} tokens, {args.rounds} alternating rounds")
    for engine in args.engines:
        times = measure(engine, args.prompts, args.length, args.rounds)
        for read in READS:
            ratios = [time / base for time, base in zip(times[read], times["baseline"])]
            print(
                f"  {engine:12s} {read:12s} {statistics.median(times[read]):7.2f} s   "
                f"x{statistics.median(ratios):.2f} the baseline (rounds {min(ratios):.2f}..{max(ratios):.2f})"
            )


if __name__ == "__main__":
    main()
