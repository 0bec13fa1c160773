"""Steering throughput on SmolLM2-135M (fp32, CPU), every configuration measured in one run.

Greedy generation of a batch of prompts x new tokens (``ignore_eos``) by: plain vLLM (its default
compiled mode); SteeredVLLM with no steering, with every request steered by one shared vector at one
layer, at 8 layers, with each request's own vector (at one layer, and at 8: as many distinct vectors as prompts in
the steering pool), with one direction ablated at every residual-stream location (`Ablate`) and capped at 8
layers (`Cap`); SteeredVLLM built to steer nothing (``max_steering_entries=0``: no steering operation in its
graph, the cost of the operation itself), and built to steer the blocks' outputs only and read no probes
(``steering_values=["layer_output"], max_probe_columns=0``: the operation once per block); StandardizedVLLM
(nnsight) steering every step; transformers ``generate`` with the same steering (a forward hook); and, to show what
compilation does, plain vLLM and SteeredVLLM with compilation off (``enforce_eager``).

Each engine lives in its own interpreter (engines set thread counts process-wide), built once; the
configurations of a phase are then measured in turn, ``--rounds`` times (nnsight and transformers, far slower,
once). In the compiled phase plain vLLM runs just before each other configuration, and that configuration's ratio
to plain vLLM is the median of those adjacent pairs' ratios (their range beside it): this machine's speed drifts by
10% and more within minutes, so a ratio of two runs far apart measures the drift. Prints tokens/s (wall clock, best
of the rounds), each ratio to plain vLLM, and the same from the processes' CPU time; asserts nothing.

Then a steering experiment's grid: 64 cells (8 vectors x 8 factors) steering the answer only
(``positions="generated"``) of one 1,000-token prompt, as `sweep` runs them (unsalted: every cell shares the
prompt's prefill), against the same 64 requests each salted apart (as every steered request was before
decode-only steering shared its prompt): throughput and the prompt tokens each computed, alternating rounds.

    python benchmarks/steering.py [--prompts 64] [--tokens 64] [--rounds 3] [--grid-only | --compiled-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from engines import MAX_MODEL_LEN, greedy_generate, prompts, transformers_batch

from nnterp_vllm.checkpoints import smollm2

LAYER, FACTOR = 10, 2.0
EIGHT_LAYERS = list(range(6, 14))
#: KV cache for every vLLM engine: room for the whole batch (the 64 MiB CPU default holds ~1400 tokens
#: of SmolLM2, so 64 x 64 would be preempted and recomputed over and over).
KV_CACHE_BYTES = 512 * 2**20
STEERED = (
    "no steering",
    "one shared vector at 1 layer",
    "one shared vector at 8 layers",
    "each request its own vector",
    "each request its own vector at 8 layers",
    "one direction ablated everywhere",
    "one direction capped at 8 layers",
)

PLAIN = "plain vLLM"
#: SteeredVLLM built to steer nothing (no steering operation in its graph, as the harvest builds it): what the
#: operation itself costs, against "SteeredVLLM, no steering".
NO_OPERATION = "SteeredVLLM built to steer nothing"
#: SteeredVLLM built to steer the blocks' outputs only and read no probes (``steering_values=["layer_output"]``,
#: ``max_probe_columns=0``): the operation once per block, not at what each attention and MLP adds nor at the first
#: block's input, and no probe read: the leanest engine that steers.
BLOCKS_ONLY = "SteeredVLLM built to steer block outputs only, no probes"
#: Phases of (engine -> the configurations it measures, whether it is measured every round): the engines
#: of a phase are alive together and measured in turn; the slow baselines, far from plain vLLM, once.
PHASES = [
    (
        {
            PLAIN: ["plain"],
            "SteeredVLLM": list(STEERED),
            NO_OPERATION: [STEERED[0]],
            BLOCKS_ONLY: [*STEERED[:5], STEERED[6]],
        },
        True,
    ),
    ({"plain vLLM, compilation off": ["plain"], "SteeredVLLM, compilation off": [STEERED[1]]}, True),
    ({"StandardizedVLLM (nnsight)": ["steering every step"]}, False),
    ({"transformers generate": ["steering hook"]}, False),
]


def vector(hidden_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(hidden_size, generator=torch.Generator().manual_seed(seed))


def plain_vllm(path: str, batch: list[str], **engine: object) -> tuple[Callable, Callable]:
    from vllm import LLM, SamplingParams

    from nnterp_vllm.engines.lifecycle import shutdown_llm

    llm = LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_CACHE_BYTES, **engine)

    def run(configuration: str, tokens: int) -> None:
        llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)

    return run, lambda: shutdown_llm(llm)


def steered_vllm(path: str, batch: list[str], **engine: object) -> tuple[Callable, Callable]:
    from vllm import SamplingParams

    from nnterp_vllm import Ablate, Cap, SteeredVLLM, Steering

    llm = SteeredVLLM(
        path, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_CACHE_BYTES, **engine
    )
    steering = dict(
        zip(
            STEERED,
            [
                None,
                Steering(LAYER, vector(llm.hidden_size), FACTOR),
                Steering(EIGHT_LAYERS, vector(llm.hidden_size), FACTOR),
                [Steering(LAYER, vector(llm.hidden_size, seed), FACTOR) for seed in range(len(batch))],
                [Steering(EIGHT_LAYERS, vector(llm.hidden_size, seed), FACTOR) for seed in range(len(batch))],
                Ablate(vector(llm.hidden_size, 1)),
                Cap(vector(llm.hidden_size, 2), EIGHT_LAYERS, min=-1.0, max=1.0),
            ],
        )
    )

    def run(configuration: str, tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        llm.generate(batch, params, steering[configuration], use_tqdm=False)

    return run, llm.shutdown


def nnsight_vllm(path: str, batch: list[str]) -> tuple[Callable, Callable]:
    from nnterp_vllm import StandardizedVLLM

    model = StandardizedVLLM(
        path, dtype="float32", dispatch=True, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_CACHE_BYTES
    )
    steer = vector(model.hidden_size)

    def run(configuration: str, tokens: int) -> None:
        with model.generate(temperature=0.0, max_tokens=tokens, ignore_eos=True) as tracer:
            for prompt in batch:
                with tracer.invoke(prompt):
                    for _ in tracer.iter[:tokens]:
                        model.steer(LAYER, steer, factor=FACTOR)

    return run, model.shutdown


def transformers_generate(path: str, batch: list[str]) -> tuple[Callable, Callable]:
    model, tokenizer, inputs = transformers_batch(path, batch)
    added = FACTOR * vector(model.config.hidden_size)
    model.model.layers[LAYER].register_forward_hook(lambda module, args, output: output + added)
    return lambda configuration, tokens: greedy_generate(model, tokenizer, inputs, tokens), lambda: None


ENGINES = {
    PLAIN: (plain_vllm, {}),
    "SteeredVLLM": (steered_vllm, {}),
    NO_OPERATION: (steered_vllm, {"max_steering_entries": 0, "max_probe_columns": 0}),
    BLOCKS_ONLY: (steered_vllm, {"steering_values": ["layer_output"], "max_probe_columns": 0}),
    "plain vLLM, compilation off": (plain_vllm, {"enforce_eager": True}),
    "SteeredVLLM, compilation off": (steered_vllm, {"enforce_eager": True}),
    "StandardizedVLLM (nnsight)": (nnsight_vllm, {}),
    "transformers generate": (transformers_generate, {}),
}


def serve(engine: str, tokens: int, batch: list[str]) -> None:
    """Worker: build ``engine``, then measure each configuration named on stdin (warming it up the first time)."""
    build, settings = ENGINES[engine]
    run, shutdown = build(str(smollm2()), batch, **settings)
    warm: set[str] = set()
    print("ready", flush=True)
    try:
        for line in sys.stdin:
            configuration = line.strip()
            if configuration not in warm:
                run(configuration, 2)  # compiles what the first steps need, fills caches
                warm.add(configuration)
            wall, cpu = time.perf_counter(), time.process_time()
            run(configuration, tokens)
            print(json.dumps([time.perf_counter() - wall, time.process_time() - cpu]), flush=True)
    finally:
        shutdown()


class Worker:
    """One engine in its own interpreter, driven line by line."""

    def __init__(self, engine: str, args: argparse.Namespace) -> None:
        command = [sys.executable, __file__, "--serve", engine, f"--prompts={args.prompts}", f"--tokens={args.tokens}"]
        self.engine = engine
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def measure(self, configuration: str) -> tuple[float, float]:
        self.process.stdin.write(configuration + "\n")
        self.process.stdin.flush()
        return tuple(json.loads(self._expect()))

    def _expect(self, word: str | None = None) -> str:
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"the {self.engine} worker exited (code {self.process.wait()})")
            if line.startswith("ready" if word else "["):
                return line

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


GRID_CELLS, GRID_PROMPT_TOKENS, GRID_NEW_TOKENS = 64, 1000, 16


def grid_child(rounds: int) -> None:
    """Worker: the 64-cell decode-only grid, shared and salted apart, in alternating rounds; one JSON line."""
    from vllm import SamplingParams

    from nnterp_vllm import SteeredVLLM, Steering

    llm = SteeredVLLM(str(smollm2()), dtype="float32", max_model_len=2048, kv_cache_memory_bytes=KV_CACHE_BYTES)
    try:
        words = " ".join(prompts(400))
        prompt_ids = llm.get_tokenizer()(words)["input_ids"][:GRID_PROMPT_TOKENS]
        specs = [
            Steering(LAYER, vector(llm.hidden_size, seed), factor, positions="generated")
            for seed in range(8)
            for factor in (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=GRID_NEW_TOKENS, ignore_eos=True)
        found: dict[str, list] = {"shared": [], "salted apart": []}
        llm.generate([{"prompt_token_ids": prompt_ids}], params, [specs[:1]], use_tqdm=False)  # warms up
        for round_ in range(rounds):
            for name in found:
                cells = [
                    {"prompt_token_ids": prompt_ids, **({"cache_salt": f"{round_}-{i}"} if name != "shared" else {})}
                    for i in range(len(specs))
                ]
                llm.reset_prefix_cache()
                wall, cpu = time.perf_counter(), time.process_time()
                outputs = llm.generate(cells, params, [[spec] for spec in specs], use_tqdm=False)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                computed = sum(len(output.prompt_token_ids) - output.num_cached_tokens for output in outputs)
                found[name].append([wall, cpu, computed])
        print(json.dumps(found), flush=True)
    finally:
        llm.shutdown()


def grid_report(rounds: int) -> None:
    done = subprocess.run(
        [sys.executable, __file__, "--grid-child", f"--rounds={rounds}"], capture_output=True, text=True
    )
    if done.returncode:
        print(f"the grid worker failed:\n{done.stderr[-3000:]}")
        return
    found = json.loads(done.stdout.strip().splitlines()[-1])
    generated = GRID_CELLS * GRID_NEW_TOKENS
    print(
        f"{GRID_CELLS}-cell grid steering the answer only, one {GRID_PROMPT_TOKENS}-token prompt, "
        f"{GRID_NEW_TOKENS} new tokens each, best of {rounds} alternating rounds:"
    )
    best = {name: [min(run[i] for run in runs) for i in range(3)] for name, runs in found.items()}
    for name, (wall, cpu, computed) in best.items():
        print(
            f"  {name:14s} {generated / wall:8.1f} new tokens/s  {wall:6.1f} s  CPU {cpu:6.1f} s  "
            f"prompt tokens computed {computed:6d}"
        )
    ratios = [salted[0] / shared[0] for shared, salted in zip(found["shared"], found["salted apart"])]
    print(
        f"  throughput, shared / salted apart: {max(ratios):.2f}x best round ({min(ratios):.2f}x..{max(ratios):.2f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grid-only", action="store_true", help="measure only the decode-only grid")
    parser.add_argument(
        "--compiled-only", action="store_true", help="measure only plain vLLM and SteeredVLLM, compiled (no grid)"
    )
    parser.add_argument("--serve", choices=sorted(ENGINES), help=argparse.SUPPRESS)
    parser.add_argument("--grid-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batch = prompts(args.prompts)
    if args.serve:
        serve(args.serve, args.tokens, batch)
        return
    if args.grid_child:
        grid_child(args.rounds)
        return
    if args.grid_only:
        grid_report(args.rounds)
        return
    best: dict[str, list[float]] = {}
    #: Each configuration's ratios to plain vLLM measured just before it (wall, CPU), one pair per round.
    paired: dict[str, list[tuple[float, float]]] = {}
    for phase, every_round in PHASES[:1] if args.compiled_only else PHASES:
        workers = {engine: Worker(engine, args) for engine in phase}

        def measured(engine: str, configuration: str, workers: dict[str, Worker] = workers) -> tuple[float, float]:
            name = engine if configuration == "plain" else f"{engine}, {configuration}"
            wall, cpu = workers[engine].measure(configuration)
            print(f"  {name}: {wall:.1f} s wall, {cpu:.1f} s CPU", file=sys.stderr, flush=True)
            best[name] = [min(pair) for pair in zip(best.get(name, [wall, cpu]), (wall, cpu))]
            return wall, cpu

        try:
            for _ in range(args.rounds if every_round else 1):
                for engine, configurations in phase.items():
                    for configuration in configurations if engine != PLAIN else ():  # plain: before each other
                        base = measured(PLAIN, "plain") if PLAIN in phase else None
                        wall, cpu = measured(engine, configuration)
                        if base is not None:
                            paired.setdefault(f"{engine}, {configuration}", []).append((base[0] / wall, base[1] / cpu))
        finally:
            for worker in workers.values():
                worker.close()
    generated = args.prompts * args.tokens
    wall_base, cpu_base = best[PLAIN]
    print(
        f"SmolLM2-135M fp32, {args.prompts} prompts x {args.tokens} new tokens, greedy; tokens/s: best of "
        f"{args.rounds} rounds; x plain: median (range) of the ratios to plain vLLM measured just before each run"
    )
    print(f"  {'':72s} {'tokens/s':>9s} {'x plain':>22s} {'CPU x plain':>12s}")
    for name, (wall, cpu) in best.items():
        if name in paired:
            walls, cpus = (sorted(ratio[i] for ratio in paired[name]) for i in (0, 1))
            ratio = f"{statistics.median(walls):.3f} ({walls[0]:.3f}-{walls[-1]:.3f})"
            cpu_ratio = f"{statistics.median(cpus):.3f}"
        else:
            ratio, cpu_ratio = f"{wall_base / wall:.3f}", f"{cpu_base / cpu:.3f}"
        print(f"  {name:72s} {generated / wall:9.1f} {ratio:>22s} {cpu_ratio:>12s}")
    if args.compiled_only:
        return
    eager, steered_eager = best["plain vLLM, compilation off"], best[f"SteeredVLLM, compilation off, {STEERED[1]}"]
    print(
        f"  compilation off, steered / plain (both eager): {eager[0] / steered_eager[0]:.3f} wall, "
        f"{eager[1] / steered_eager[1]:.3f} CPU"
    )
    grid_report(args.rounds)


if __name__ == "__main__":
    main()
