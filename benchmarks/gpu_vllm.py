"""The vLLM half of ``gpu.py``: plain vLLM against SteeredVLLM, steering and capturing, and SteeredVLLM against
its eager self."""

from __future__ import annotations

import argparse
import os
from functools import partial
from typing import Any

from gpu_measure import Results, no_wait, relative_row_error, timed
from gpu_model import EVERY_BLOCK, checkpoint, model_line, random_rows, scale

#: Blocks each steered request adds its vector at (the middle ones; fewer where the model has fewer).
STEERED_BLOCKS = 8
#: Standard deviation of each steering vector's elements.
VECTOR_SCALE = 0.05
#: Greedy runs may part where the reference's best token beats the one taken by at most this (bf16 near-ties).
TIE_NATS = 0.1
#: Largest relative error (``|row - reference| / |reference|``) of a captured row against the eager engine's.
ROW_TOLERANCE = 0.05
TARGETS = {"steering": 0.95, "capture": 0.9}


def stop(llm: Any) -> None:
    """Stop a plain ``vllm.LLM``'s engine (its own ``shutdown`` where this vLLM has one)."""
    if hasattr(llm, "shutdown"):
        llm.shutdown()
    else:
        llm.llm_engine.engine_core.shutdown()


def engine_line(llm: Any, results: Results, compiled: bool) -> str:
    """How ``llm`` runs its model; a compiled engine without CUDA graphs fails a check."""
    config = llm.llm_engine.vllm_config
    mode, graphs = (getattr(config.compilation_config, name, None) for name in ("mode", "cudagraph_mode"))
    if compiled:
        graphs_name = getattr(graphs, "name", graphs)
        results.check(graphs_name not in ("NONE", None), f"{type(llm).__name__} runs CUDA graphs ({graphs_name})")
    return (
        f"compilation {getattr(mode, 'name', mode)}, CUDA graphs {getattr(graphs, 'name', graphs)}, "
        f"async scheduling {getattr(config.scheduler_config, 'async_scheduling', '?')}"
    )


def greedy_steps(outputs: list) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Per output: its generated tokens and, per step, the logprobs vLLM returned (its best and the token taken)."""
    return [
        (
            list(output.outputs[0].token_ids),
            [{token: entry.logprob for token, entry in step.items()} for step in output.outputs[0].logprobs],
        )
        for output in outputs
    ]


def compare_greedy(runs: list, reference: list) -> tuple[int, list[float], list[int]]:
    """How many prompts' tokens equal the reference's; the gaps where a run parted from it at a near-tie; the
    prompts where it parted otherwise (the token taken not within `TIE_NATS` of the reference's best there)."""
    identical, ties, mismatched = 0, [], []
    for number, ((tokens, _), (expected, steps)) in enumerate(zip(runs, reference)):
        if tokens == expected:
            identical += 1
            continue
        parted = next((k for k, (token, wanted) in enumerate(zip(tokens, expected)) if token != wanted), None)
        gap = float("inf") if parted is None else max(steps[parted].values()) - steps[parted].get(tokens[parted], -1e9)
        if gap <= TIE_NATS:
            ties.append(gap)
        else:
            mismatched.append(number)
    return identical, ties, mismatched


def no_eager_calls(results: Results, stats: list[dict[str, Any]], what: str) -> None:
    """Check that each worker's ``eager_calls`` is 0."""
    calls = [worker.get("eager_calls") for worker in stats]
    results.check(bool(calls) and all(call == 0 for call in calls), f"{what}: eager_calls per worker {calls}")


def vllm_half(args: argparse.Namespace) -> Results:
    """Plain vLLM against SteeredVLLM, steering and capturing, and SteeredVLLM against its eager self."""
    from nnterp_vllm.engines.vllm_environment import choose_model_runner

    choose_model_runner("plain vLLM")  # the runner SteeredVLLM runs, for a like-for-like baseline
    import torch
    import vllm
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    from nnterp_vllm import Capture, SteeredVLLM, Steering

    sizes = scale(args)
    path = checkpoint(args)
    config = AutoConfig.from_pretrained(path).get_text_config()
    print(
        f"vLLM half on {torch.cuda.get_device_name()}: vLLM {vllm.__version__}, torch {torch.__version__}, bfloat16, "
        f"VLLM_USE_V2_MODEL_RUNNER={os.environ['VLLM_USE_V2_MODEL_RUNNER']}"
    )
    print(model_line(path))
    engine = {"dtype": "bfloat16", "max_model_len": min(config.max_position_embeddings, 2048), "seed": 0}
    prompts = [
        {"prompt_token_ids": ids} for ids in random_rows(config.vocab_size, sizes.prompts, sizes.prompt_tokens, 2)
    ]
    # New prompts each round (and for the warm-up): a round is never served from the prefix cache.
    prefills = [
        [
            {"prompt_token_ids": ids}
            for ids in random_rows(config.vocab_size, sizes.prefill_prompts, sizes.prefill_tokens, seed)
        ]
        for seed in range(100, 101 + args.rounds)
    ]
    first = max(0, config.num_hidden_layers // 2 - STEERED_BLOCKS // 2)
    blocks = list(range(first, min(config.num_hidden_layers, first + STEERED_BLOCKS)))
    steering = [
        Steering(blocks, torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(i)) * VECTOR_SCALE)
        for i in range(sizes.prompts)
    ]
    generation = SamplingParams(temperature=0.0, max_tokens=sizes.new_tokens, ignore_eos=True)
    checked = SamplingParams(temperature=0.0, max_tokens=sizes.new_tokens, ignore_eos=True, logprobs=2)
    prefill = SamplingParams(temperature=0.0, max_tokens=1)
    capture = Capture(EVERY_BLOCK, positions="prompt")
    results = Results()
    found: dict[str, Any] = {"blocks": blocks}

    with results.step("plain vLLM"):
        llm = LLM(str(path), **engine)
        try:
            print(f"  plain vLLM: {engine_line(llm, results, compiled=True)}")
            llm.generate(prompts, generation, use_tqdm=False)  # warm-up: one untimed round of each workload
            llm.generate(prefills[-1], prefill, use_tqdm=False)
            for round_ in range(args.rounds):
                seconds, outputs = timed(partial(llm.generate, prompts, generation, use_tqdm=False), no_wait)
                results.add("plain generate", seconds)
                results.add(
                    "plain prefill", timed(partial(llm.generate, prefills[round_], prefill, use_tqdm=False), no_wait)[0]
                )
            found["plain tokens"] = [list(output.outputs[0].token_ids) for output in outputs]
        finally:
            stop(llm)

    with results.step("SteeredVLLM, steering"):
        llm = SteeredVLLM(path, **engine)
        try:
            print(f"  SteeredVLLM: {engine_line(llm, results, compiled=True)}")
            llm.generate(prompts, generation, steering, use_tqdm=False)  # warm-up: one untimed round
            for _ in range(args.rounds):
                results.add(
                    "steered generate",
                    timed(partial(llm.generate, prompts, generation, steering, use_tqdm=False), no_wait)[0],
                )
            found["steered"] = greedy_steps(llm.generate(prompts, checked, steering, use_tqdm=False))
            no_eager_calls(results, llm.steering_stats(), "steering ran inside the compiled graph")
        finally:
            llm.shutdown()

    with results.step("SteeredVLLM, capture"):
        llm = SteeredVLLM(path, capture_values=[EVERY_BLOCK], **engine)
        try:
            print(f"  SteeredVLLM keeping {EVERY_BLOCK}: {engine_line(llm, results, compiled=True)}")
            llm.generate(prefills[-1], prefill, capture=capture, use_tqdm=False)  # warm-up: one untimed round
            for round_ in range(args.rounds):
                seconds, outputs = timed(
                    partial(llm.generate, prefills[round_], prefill, capture=capture, use_tqdm=False), no_wait
                )
                results.add("captured prefill", seconds)
                if round_ == 0:
                    found["captured"] = [output.activations for output in outputs[: sizes.checked_prompts]]
                    names = [f"layers.{i}.layer_output" for i in range(config.num_hidden_layers)]
                    shapes = {
                        (name, tuple((output.activations or {}).get(name, torch.empty(0)).shape))
                        for output in outputs
                        for name in names
                    }
                    results.check(
                        shapes == {(name, (sizes.prefill_tokens, config.hidden_size)) for name in names},
                        f"every prompt kept {len(names)} values of {sizes.prefill_tokens} x {config.hidden_size} rows",
                    )
                del outputs
            no_eager_calls(results, llm.capture_stats(), "capture ran inside the compiled graph")
            no_eager_calls(results, llm.steering_stats(), "the capture engine's steering ran inside the compiled graph")
        finally:
            llm.shutdown()

    with results.step("SteeredVLLM, enforce_eager (the reference)"):
        llm = SteeredVLLM(path, capture_values=[EVERY_BLOCK], enforce_eager=True, **engine)
        try:
            print(f"  SteeredVLLM, enforce_eager: {engine_line(llm, results, compiled=False)}")
            found["eager steered"] = greedy_steps(llm.generate(prompts, checked, steering, use_tqdm=False))
            outputs = llm.generate(prefills[0], prefill, capture=capture, use_tqdm=False)
            found["eager captured"] = [output.activations for output in outputs[: sizes.checked_prompts]]
            del outputs
        finally:
            llm.shutdown()

    report_vllm(args, results, found)
    return results


def report_vllm(args: argparse.Namespace, results: Results, found: dict[str, Any]) -> None:
    """Throughputs, ratios and the checks against the eager engine."""
    sizes = scale(args)
    generated = sizes.prompts * sizes.new_tokens
    prefilled = sizes.prefill_prompts * sizes.prefill_tokens
    print(
        f"steering: {sizes.prompts} prompts of {sizes.prompt_tokens} tokens x {sizes.new_tokens} new tokens, greedy, "
        f"{sizes.prompts} distinct vectors at blocks {found['blocks']}; capture: {sizes.prefill_prompts} prompts x "
        f"{sizes.prefill_tokens} tokens, max_tokens=1, every block's layer_output at the prompt's positions; "
        f"{args.rounds} rounds per engine, medians"
    )
    rows = [
        ("plain generate", "plain vLLM, generation", generated, "new"),
        ("steered generate", f"SteeredVLLM, {sizes.prompts} distinct vectors, generation", generated, "new"),
        ("plain prefill", "plain vLLM, prefill", prefilled, "prompt"),
        ("captured prefill", "SteeredVLLM, prefill keeping every block", prefilled, "prompt"),
    ]
    for key, label, tokens, kind in rows:
        if key in results.seconds:
            print(f"  {label:58s} {tokens / results.median(key):9.0f} {kind} tokens/s  {results.median(key):7.3f} s")
    results.ratio("steering / plain vLLM, tokens/s", "plain generate", "steered generate", TARGETS["steering"], False)
    results.ratio("capture / plain prefill, tokens/s", "plain prefill", "captured prefill", TARGETS["capture"], False)
    print("against SteeredVLLM(..., enforce_eager=True) on the same requests:")
    if "steered" in found and "eager steered" in found:
        identical, ties, mismatched = compare_greedy(found["steered"], found["eager steered"])
        widest = f", widest gap {max(ties):.3f}" if ties else ""
        results.check(
            not mismatched,
            f"greedy tokens: {identical} prompts identical, {len(ties)} part at a near-tie (<= {TIE_NATS} nats"
            f"{widest}), {len(mismatched)} differ otherwise {mismatched[:8]}",
        )
    if "steered" in found and "plain tokens" in found:
        changed = sum(tokens != plain for (tokens, _), plain in zip(found["steered"], found["plain tokens"]))
        print(f"  info steering changed the greedy tokens of {changed} of {sizes.prompts} prompts against plain vLLM")
    if "captured" in found and "eager captured" in found:
        errors = [
            relative_row_error(kept[name], reference[name]) if kept and name in kept else float("inf")
            for kept, reference in zip(found["captured"], found["eager captured"])
            for name in reference or {}
        ]
        worst = max(errors, default=float("inf"))
        results.check(
            worst <= ROW_TOLERANCE,
            f"captured rows of {len(found['captured'])} prompts x every block: worst relative row error {worst:.2e} "
            f"(<= {ROW_TOLERANCE})",
        )
