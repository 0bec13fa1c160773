"""Experiments at serving throughput on SmolLM2-135M (fp32, CPU), each against its baseline in one run.

1. **Activation patching.** A logit-difference sweep of ``--layers`` blocks x ``--positions`` prompt positions
   (30 x 16 by default: every block, the prompt's last 16 positions): `patch_sweep` on `SteeredVLLM` (every cell a
   request of one batch, its metric read in the worker) against the loop researchers write with forward hooks on
   transformers (one hooked forward per cell) and against the same loop as nnsight traces on `StandardizedVLLM`
   (one trace per cell). Their tables are compared (the largest difference is printed).
2. **The shared prefix.** The same sweep on a prompt of several prefix-cache blocks, its cells patched in its last
   block: as `patch_sweep` runs them (each cell shares the prompt's blocks before its position) against the same
   cells each salted apart (every cell's prompt computed whole), alternating ``--rounds`` rounds.
3. **Probes.** ``--prompts`` prompts x ``--tokens`` new tokens, greedy, with a probe read on every token at one
   block against the same generation without it; and steering at 8 blocks gated by a probe against the same
   steering ungated; alternating ``--rounds`` rounds, each keeping its best.

Each engine is built once, in this process (one at a time). Prints times and ratios; asserts nothing.

    python benchmarks/experiments.py [--layers 30] [--positions 16] [--rounds 3] [--prompts 64] [--tokens 64]
"""

from __future__ import annotations

import argparse
import time

import torch
from engines import prompts

from nnterp_vllm.checkpoints import smollm2

#: The sweep's prompts: a fact stated, then asked about; the corrupt one names the other person (as long as the
#: clean one, token for token).
CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPT = "When Mary and John went to the store, Mary gave a drink to"
#: A prompt of several prefix-cache blocks (the CPU build's blocks are 128 tokens), for the shared prefix.
FILLER = "The shop on the corner sells bread, milk, fruit and newspapers every morning. " * 24
#: The README's engine settings (one compiled model for every SmolLM2 engine of the project), room for the batch.
ENGINE = {"dtype": "float32", "max_model_len": 512, "capture_values": ["layers.*.layer_output"]}
KV_CACHE_BYTES = 512 * 2**20


def timed(run) -> tuple[float, object]:
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def hook_loop(model, tokenizer, layers, positions, correct, wrong) -> torch.Tensor:
    """The sweep as a loop of hooked forwards on transformers' own model: one keeping the clean run's block outputs,
    one per cell setting one of them into the corrupt run."""
    clean = torch.tensor([tokenizer(CLEAN)["input_ids"]])
    corrupt = torch.tensor([tokenizer(CORRUPT)["input_ids"]])
    blocks = model.model.layers
    kept = {}
    handles = [
        blocks[layer].register_forward_hook(lambda m, a, out, layer=layer: kept.__setitem__(layer, out.clone()))
        for layer in layers
    ]
    with torch.no_grad():
        model(clean)
        for handle in handles:
            handle.remove()
        values = torch.empty(len(layers), len(positions))
        for i, layer in enumerate(layers):
            for j, position in enumerate(positions):

                def patched(m, a, out, layer=layer, position=position):
                    stream = out.clone()
                    stream[0, position] = kept[layer][0, position]
                    return stream

                handle = blocks[layer].register_forward_hook(patched)
                logits = model(corrupt).logits[0, -1]
                handle.remove()
                values[i, j] = logits[correct] - logits[wrong]
    return values


def trace_loop(model, layers, positions, correct, wrong) -> torch.Tensor:
    """The same loop in nnsight traces, on either engine: one trace keeping the clean values, one per cell."""
    with model.trace(CLEAN):
        kept = [model.layers[layer].layer_output[0, positions].save() for layer in layers]
    values = torch.empty(len(layers), len(positions))
    for i, layer in enumerate(layers):
        for j, position in enumerate(positions):
            with model.trace(CORRUPT):
                model.patch(layer, kept[i][j], [position])
                logits = model.logits[0, -1].save()
            values[i, j] = logits[correct] - logits[wrong]
    return values


def sweeps(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nnterp_vllm import LogitDiff, StandardizedVLLM, SteeredVLLM, patch_sweep
    from nnterp_vllm.engines.lifecycle import shutdown

    path = str(smollm2())
    tokenizer = AutoTokenizer.from_pretrained(path)
    length = len(tokenizer(CLEAN)["input_ids"])
    layers = list(range(args.layers))
    positions = list(range(max(0, length - args.positions), length))
    correct, wrong = (tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in (" Mary", " John"))
    metric = LogitDiff(correct, wrong)
    cells = len(layers) * len(positions)
    print(f"Patching: {len(layers)} layers x {len(positions)} positions = {cells} cells, SmolLM2-135M fp32")

    llm = SteeredVLLM(path, kv_cache_memory_bytes=KV_CACHE_BYTES, **ENGINE)
    try:
        patch_sweep(llm, CLEAN, CORRUPT, layers=[0], positions=positions[:1], metric=metric)  # warms up
        ours, swept = timed(lambda: patch_sweep(llm, CLEAN, CORRUPT, layers, positions, metric))
        shared = shared_prefix(llm, tokenizer, metric, args.rounds)
    finally:
        llm.shutdown()
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hooks, hooked = timed(lambda: hook_loop(plain, tokenizer, layers, positions, correct, wrong))
    traced_model = StandardizedVLLM(path, dtype="float32", max_model_len=512, dispatch=True)
    try:
        trace_loop(traced_model, layers[:1], positions[:1], correct, wrong)  # compiles the trace blocks
        traces, traced = timed(lambda: trace_loop(traced_model, layers, positions, correct, wrong))
    finally:
        shutdown(traced_model)
    for name, wall in (
        ("patch_sweep on SteeredVLLM", ours),
        ("hook loop on transformers", hooks),
        ("nnsight traces on StandardizedVLLM", traces),
    ):
        print(f"  {name:36s} {wall:8.1f} s  {cells / wall:8.1f} cells/s  patch_sweep is {wall / ours:.1f}x as fast")
    print(
        f"  largest difference from the hook loop: patch_sweep {float((swept.values - hooked).abs().max()):.2e}, "
        f"traces {float((traced - hooked).abs().max()):.2e}"
    )
    print(
        f"Shared prefix: {shared['cells']} cells patched in the last block of a {shared['tokens']}-token prompt, best "
        f"of {args.rounds} alternating rounds: shared {shared['shared']:.2f} s ({shared['computed shared']} prompt "
        f"tokens computed), salted apart {shared['apart']:.2f} s ({shared['computed apart']}): "
        f"{shared['apart'] / shared['shared']:.2f}x"
    )


def shared_prefix(llm, tokenizer, metric, rounds: int) -> dict:
    """The same cells as `patch_sweep` runs them (sharing the prompt's blocks before each cell's position) and
    each salted apart, in alternating rounds: best times and prompt tokens computed."""
    from vllm import SamplingParams

    from nnterp_vllm import Capture, Patch

    clean_ids = tokenizer(FILLER + CLEAN)["input_ids"]
    corrupt_ids = tokenizer(FILLER + CORRUPT)["input_ids"]
    positions = list(range(len(clean_ids) - 8, len(clean_ids)))
    layers = list(range(0, 30, 3))
    names = [f"layers.{layer}.layer_output" for layer in layers]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    (clean,) = llm.generate({"prompt_token_ids": clean_ids}, params, capture=Capture(names, positions), use_tqdm=False)
    cells = [
        [Patch(clean.activations[name][index], layers=layer, positions=[position])]
        for layer, name in zip(layers, names)
        for index, position in enumerate(positions)
    ]
    found = {"shared": [], "apart": [], "computed shared": 0, "computed apart": 0}
    for round_ in range(rounds):
        for name in ("shared", "apart"):
            llm.reset_prefix_cache()
            llm.generate({"prompt_token_ids": corrupt_ids}, params, use_tqdm=False)  # the corrupt run, cached
            prompts_ = [
                {"prompt_token_ids": corrupt_ids, **({"cache_salt": f"{round_}-{i}"} if name == "apart" else {})}
                for i in range(len(cells))
            ]
            wall, outputs = timed(
                lambda prompts_=prompts_: llm.generate(prompts_, params, cells, metric=metric, use_tqdm=False)
            )
            found[name].append(wall)
            found[f"computed {name}"] = sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outputs)
    return {
        "shared": min(found["shared"]),
        "apart": min(found["apart"]),
        "computed shared": found["computed shared"],
        "computed apart": found["computed apart"],
        "cells": len(cells),
        "tokens": len(corrupt_ids),
    }


def probes(args: argparse.Namespace) -> None:
    from vllm import SamplingParams

    from nnterp_vllm import Probe, SteeredVLLM, Steering

    llm = SteeredVLLM(str(smollm2()), kv_cache_memory_bytes=KV_CACHE_BYTES, **ENGINE)
    batch = prompts(args.prompts)
    generator = torch.Generator().manual_seed(0)
    probe = Probe(torch.randn(llm.hidden_size, generator=generator), layer=10, activation="sigmoid")
    gate = Probe(torch.randn(llm.hidden_size, generator=generator) / 24, layer=6)
    vector = torch.randn(llm.hidden_size, generator=generator)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    runs = {
        "plain": lambda: llm.generate(batch, params, use_tqdm=False),
        "a probe on every token": lambda: llm.generate(batch, params, probes={"p": probe}, use_tqdm=False),
        "steering at 8 blocks": lambda: llm.generate(
            batch, params, Steering(list(range(6, 14)), vector), use_tqdm=False
        ),
        "the same, gated by a probe": lambda: llm.generate(
            batch, params, Steering(list(range(6, 14)), vector, when=(gate, ">", 0.0)), use_tqdm=False
        ),
    }
    try:
        for run in runs.values():
            run()  # warms up
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.rounds):
            for name, run in runs.items():
                best[name] = min(best[name], timed(run)[0])
    finally:
        llm.shutdown()
    generated = args.prompts * args.tokens
    print(f"Probes and gates: {args.prompts} prompts x {args.tokens} new tokens, best of {args.rounds} rounds")
    for name, wall in best.items():
        print(f"  {name:28s} {generated / wall:8.1f} tokens/s")
    print(f"  probed / plain:  {best['plain'] / best['a probe on every token']:.3f}x")
    print(f"  gated / ungated: {best['steering at 8 blocks'] / best['the same, gated by a probe']:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--positions", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--only", choices=["sweeps", "probes"], help="measure one half")
    args = parser.parse_args()
    if args.only != "probes":
        sweeps(args)
    if args.only != "sweeps":
        probes(args)


if __name__ == "__main__":
    main()
