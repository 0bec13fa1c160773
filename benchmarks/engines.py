"""Throughput of the two engines on SmolLM2-135M (fp32, CPU), measured in one run.

Generation of a batch of prompts x new tokens (greedy, no early stop) by: plain vLLM,
StandardizedVLLM with no intervention, StandardizedVLLM steering every step, and plain
transformers ``generate``; then the time of a single-prompt one-token StandardizedVLLM
trace against the same request on plain vLLM. Prints tokens/s and ratios; asserts nothing.

    python benchmarks/engines.py [--prompts 32] [--tokens 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
if "VLLM_RPC_BASE_PATH" not in os.environ:  # a benchmark's worker processes share their parent's
    os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="nnterp-vllm-bench-")
    atexit.register(shutil.rmtree, os.environ["VLLM_RPC_BASE_PATH"], True)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from nnterp_vllm.checkpoints import smollm2  # noqa: E402
from nnterp_vllm.engines.engine_defaults import engine_kwargs  # noqa: E402
from nnterp_vllm.engines.vllm import StandardizedVLLM  # noqa: E402

SUBJECTS = ["The Eiffel Tower", "A good cup of coffee", "The history of Rome", "Quantum computers", "My favourite book"]
MAX_MODEL_LEN = 512


def prompts(count: int) -> list[str]:
    return [f"{SUBJECTS[i % len(SUBJECTS)]} (note {i}) is" for i in range(count)]


def best_of(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up: compiles trace blocks, fills caches
    return min(_timed(run) for _ in range(repeats))


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def plain_vllm(path: str, batch: list[str], tokens: int, repeats: int) -> tuple[float, float]:
    from vllm import LLM, SamplingParams

    llm = LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN, **engine_kwargs())
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    try:
        generation = best_of(lambda: llm.generate(batch, params, use_tqdm=False), repeats)
        single = statistics.median(_timed(lambda: llm.generate(batch[:1], one, use_tqdm=False)) for _ in range(10))
    finally:
        llm.llm_engine.engine_core.shutdown()
    return generation, single


def standardized_vllm(path: str, batch: list[str], tokens: int, repeats: int) -> tuple[float, float, float]:
    model = StandardizedVLLM(path, dtype="float32", dispatch=True, max_model_len=MAX_MODEL_LEN)
    vector = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(0))
    sampling = {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True}

    def untouched() -> None:
        with model.generate(**sampling) as tracer:
            for prompt in batch:
                with tracer.invoke(prompt):
                    pass

    def steered() -> None:
        with model.generate(**sampling) as tracer:
            for prompt in batch:
                with tracer.invoke(prompt):
                    for _ in tracer.iter[:tokens]:
                        model.steer(10, vector, factor=2.0)

    def single() -> None:
        with model.trace(batch[0]):
            model.logits.save()

    try:
        plain = best_of(untouched, repeats)
        steering = best_of(steered, repeats)
        single()
        one = statistics.median(_timed(single) for _ in range(10))
    finally:
        model.shutdown()
    return plain, steering, one


def transformers_generate(path: str, batch: list[str], tokens: int, repeats: int) -> float:
    model, tokenizer, inputs = transformers_batch(path, batch)
    return best_of(lambda: greedy_generate(model, tokenizer, inputs, tokens), repeats)


def transformers_batch(path: str, batch: list[str]) -> tuple:
    """The plain transformers model, its tokenizer (padding left) and the padded batch."""
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tokenizer, tokenizer(batch, return_tensors="pt", padding=True)


def greedy_generate(model: object, tokenizer: object, inputs: dict, tokens: int) -> None:
    """transformers ``generate``: ``tokens`` new tokens per prompt, greedy, no early stop."""
    with torch.no_grad():
        model.generate(
            **inputs,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )


MEASUREMENTS = {"vllm": plain_vllm, "standardized": standardized_vllm, "transformers": transformers_generate}


def measure_in_subprocess(name: str, args: argparse.Namespace) -> list[float]:
    """One measurement in a fresh interpreter: engines set thread counts process-wide."""
    command = [sys.executable, __file__, "--only", name, *(f"--{key}={getattr(args, key)}" for key in OPTIONS)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


OPTIONS = ("prompts", "tokens", "repeats")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=sorted(MEASUREMENTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    path = str(smollm2())
    batch = prompts(args.prompts)
    if args.only:
        seconds = MEASUREMENTS[args.only](path, batch, args.tokens, args.repeats)
        print(json.dumps(list(seconds) if isinstance(seconds, tuple) else [seconds]))
        return
    generated = args.prompts * args.tokens
    vllm_seconds, vllm_single = measure_in_subprocess("vllm", args)
    ours_seconds, steered_seconds, ours_single = measure_in_subprocess("standardized", args)
    (hf_seconds,) = measure_in_subprocess("transformers", args)
    steered, untouched = "StandardizedVLLM, steering every step", "StandardizedVLLM, no intervention"
    rate = {
        "plain vLLM": generated / vllm_seconds,
        untouched: generated / ours_seconds,
        steered: generated / steered_seconds,
        "transformers generate": generated / hf_seconds,
    }
    print(f"SmolLM2-135M fp32, {args.prompts} prompts x {args.tokens} new tokens")
    for name, tokens_per_second in rate.items():
        print(f"  {name:40s} {tokens_per_second:8.1f} tokens/s")
    print(f"  steered / plain vLLM: {rate[steered] / rate['plain vLLM']:.3f}")
    print(f"  no intervention / plain vLLM: {rate[untouched] / rate['plain vLLM']:.3f}")
    print(f"  steered StandardizedVLLM / transformers generate: {rate[steered] / rate['transformers generate']:.3f}")
    overhead = (ours_single - vllm_single) * 1e3
    print(
        f"  single-prompt trace: StandardizedVLLM {ours_single * 1e3:.1f} ms, plain vLLM {vllm_single * 1e3:.1f} ms "
        f"(+{overhead:.1f} ms, ratio {ours_single / vllm_single:.2f})"
    )


if __name__ == "__main__":
    main()
