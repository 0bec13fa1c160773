"""What steering, capture, tracing and harvesting cost on one GPU, each against its plain baseline in the same run.

One prepared script for a CUDA machine, sized to run everything in about 5 minutes on one H200; it runs
what the machine has the packages (and a GPU) for, and says what it skipped and why.

**The vLLM half** (vLLM's CUDA build and a GPU): plain ``vllm.LLM`` against `SteeredVLLM`, every engine
under vLLM's defaults (compiled model, CUDA graphs, asynchronous scheduling; no ``enforce_eager``), one
engine alive at a time (each is shut down before the next is built), so each engine measures its
``--rounds`` back to back and a ratio is of the two sides' medians:

- steering: 64 prompts x 64 new tokens (greedy, ``ignore_eos``), each prompt steered by its own random
  vector (64 distinct vectors) at 8 blocks, generation tokens/s against plain vLLM's on the same requests;
- capture: every block's residual stream (``capture_values=["layers.*.layer_output"]``,
  ``Capture("layers.*.layer_output", positions="prompt")``) over a prefill workload (``max_tokens=1``,
  new prompts each round, so that no round is served from the prefix cache), prompt tokens/s against plain
  vLLM prefilling the same prompts;
- checks: no steering or capture operation ran outside the compiled graph (``eager_calls`` of
  ``steering_stats()`` and ``capture_stats()`` stay 0), the compiled engines ran with CUDA graphs, and the
  outputs equal a ``SteeredVLLM(..., enforce_eager=True)`` run of the same requests: the greedy tokens
  (where two runs part, the token taken must be within `TIE_NATS` of the reference's best there: a bf16
  near-tie, after which the rest is not compared) and the captured rows (each row's relative error within
  `ROW_TOLERANCE`).

SteeredVLLM runs vLLM's V1 model runner (it chooses it itself; vLLM would pick its V2 runner wherever Triton
works): plain vLLM is made to run the same runner, so both sides differ only by steering and capture.

**The torch half** (torch, transformers and nnsight; on ``--device``, CUDA where there is one):

- trace overhead: a `StandardizedTransformer` trace saving one block's ``layer_output`` / every block's,
  against a raw nnsight ``TransformersModel`` trace saving the same native block outputs and against a plain
  forward with ``output_hidden_states=True`` (all three sdpa attention, no KV cache, one batch of tokens);
- harvest: tokens/s of the project's harvest (``engine="hf"``) of every block's ``layer_output`` to disk,
  against a plain forward of the base model with ``output_hidden_states=True`` over the same token batches
  (its hidden states kept on the device), and the harvested rows against that forward's.

The torch half runs each pair in alternating rounds (one model of each kind alive throughout): per
configuration the median of its calls, per ratio the median of the rounds' ratios. Prints the device, the
versions, absolute times and tokens/s, and each ratio with its target where there is one. Exits 1 when a
check fails or a step raises (printed, and the rest still runs); a target missed is printed, not failed.

Targets: steering with 64 distinct vectors >= 0.95x plain vLLM's generation throughput; capture of every
block's residual stream >= 0.9x plain vLLM's prefill throughput.

The model is ``--model`` (a checkpoint directory with its tokenizer), or by default a random-weight Llama
built offline once into the package's cache directory (``$NNTERP_VLLM_CACHE``): hidden 2048, 16 blocks,
16 heads, 8 KV heads, head_dim 128, vocabulary 32000 (about 1.1B parameters, bfloat16), with a word-level
tokenizer over its vocabulary; ``--small`` builds a 4-block one and shrinks every workload (a quick check,
also on a CPU). On a GPU node, from the repository root:

    python benchmarks/gpu.py [--only torch|vllm] [--rounds 3] [--small] [--device cuda|cpu] [--model DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the package of this checkout, whether or not it is installed
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model is a local directory
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: The value both capture and harvest keep: every block's residual stream.
EVERY_BLOCK = "layers.*.layer_output"
#: Blocks each steered request adds its vector at (the middle ones; fewer where the model has fewer).
STEERED_BLOCKS = 8
#: Standard deviation of each steering vector's elements.
VECTOR_SCALE = 0.05
#: Greedy runs may part where the reference's best token beats the one taken by at most this (bf16 near-ties).
TIE_NATS = 0.1
#: Largest relative error (``|row - reference| / |reference|``) of a captured row against the eager engine's.
ROW_TOLERANCE = 0.05
#: Relative error allowed between a harvested row and the plain forward's.
HARVEST_TOLERANCE = 0.02
TARGETS = {"steering": 0.95, "capture": 0.9}
PARTS = ("torch", "vllm")


@dataclass(frozen=True)
class Scale:
    """The model built when no ``--model`` is given, and every workload's size."""

    model: dict[str, int]
    trace_batch: int  # rows x tokens of the traced batch
    trace_tokens: int
    calls: int  # timed calls of each trace configuration per round
    harvest_rows: int  # rows of harvest_tokens tokens (BOS included), harvested harvest_batch at a time
    harvest_tokens: int
    harvest_batch: int
    prompts: int  # steered prompts (each its own vector) of prompt_tokens tokens, new_tokens generated
    prompt_tokens: int
    new_tokens: int
    prefill_prompts: int  # prompts of prefill_tokens tokens per capture round
    prefill_tokens: int
    checked_prompts: int  # captured prompts whose rows are compared with the eager engine's


#: The random Llama's config: (full size, --small).
LLAMA = {
    "hidden_size": (2048, 256),
    "intermediate_size": (8192, 512),
    "num_hidden_layers": (16, 4),
    "num_attention_heads": (16, 4),
    "num_key_value_heads": (8, 2),
    "head_dim": (128, 64),
    "vocab_size": (32000, 1024),
    "max_position_embeddings": (2048, 512),
}
#: Every workload's size (`Scale`'s fields): (full size, --small).
WORKLOADS = {
    "trace_batch": (8, 2),
    "trace_tokens": (512, 64),
    "calls": (10, 5),
    "harvest_rows": (64, 16),
    "harvest_tokens": (512, 64),
    "harvest_batch": (8, 4),
    "prompts": (64, 64),
    "prompt_tokens": (32, 16),
    "new_tokens": (64, 16),
    "prefill_prompts": (128, 32),
    "prefill_tokens": (512, 128),
    "checked_prompts": (8, 4),
}


# -- the model ------------------------------------------------------------------------------------------------


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer whose vocabulary is exactly ``vocab_size`` tokens: ``<pad> <s> </s> <unk> w4 w5 ...``."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    words = [*specials.values(), *(f"w{i}" for i in range(len(specials), vocab_size))]
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel({word: i for i, word in enumerate(words)}, "<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=model, **specials)


def random_llama(sizes: dict[str, int], dtype: str) -> Path:
    """A random-weight Llama checkpoint of ``sizes`` stored in ``dtype``, with `word_tokenizer`, built once (on the
    GPU where there is one) into the package's cache directory; its directory."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from nnterp_vllm.checkpoints import cache_dir

    key = json.dumps([sizes, dtype, transformers.__version__], sort_keys=True).encode()
    path = cache_dir() / "benchmark-models" / f"llama-{hashlib.sha256(key).hexdigest()[:12]}"
    if (path / "config.json").exists():
        return path
    config = LlamaConfig(**sizes, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    staging = path.with_name(f"{path.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    word_tokenizer(config.vocab_size).save_pretrained(staging)
    staging.rename(path)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the engines built next in this process see the whole GPU
    return path


def checkpoint(args: argparse.Namespace) -> Path:
    """The model both halves load: ``--model``, or the random Llama of this scale."""
    if args.model:
        return Path(args.model)
    return random_llama(scale(args).model, "float32" if args.small else "bfloat16")


def scale(args: argparse.Namespace) -> Scale:
    """The sizes ``args`` ask for: full, or ``--small``."""
    column = int(args.small)
    return Scale(
        model={key: sizes[column] for key, sizes in LLAMA.items()},
        **{key: sizes[column] for key, sizes in WORKLOADS.items()},
    )


def random_rows(vocab_size: int, rows: int, tokens: int, seed: int) -> list[list[int]]:
    """``rows`` lists of ``tokens`` token ids drawn from a seeded generator, special ids (below 4) left out."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab_size, (rows, tokens), generator=generator).tolist()


def model_line(path: Path) -> str:
    """The model's shape, in one line."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path).get_text_config()
    return (
        f"model {path}: {config.num_hidden_layers} blocks, "
        f"hidden {config.hidden_size}, {config.num_attention_heads} heads / {config.num_key_value_heads} KV heads, "
        f"vocabulary {config.vocab_size}"
    )


# -- measuring and reporting -----------------------------------------------------------------------------------


class Results:
    """What a half measured: per configuration its seconds per round; the checks that failed."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self.failures: list[str] = []

    def add(self, name: str, seconds: float) -> None:
        """Record one round's seconds of ``name``."""
        self.seconds.setdefault(name, []).append(seconds)

    def median(self, name: str) -> float:
        """The median of ``name``'s rounds."""
        return statistics.median(self.seconds[name])

    def ratio(self, label: str, top: str, bottom: str, target: float | None = None, paired: bool = True) -> None:
        """Print ``top``'s seconds over ``bottom``'s (a time ratio; inverted, a tokens/s one): the median of the
        rounds' ratios where ``paired`` (the two measured in alternating rounds), else the ratio of the medians."""
        if top not in self.seconds or bottom not in self.seconds:
            print(f"  {label:58s} not measured")
            return
        if paired:
            each = [a / b for a, b in zip(self.seconds[top], self.seconds[bottom])]
            value = statistics.median(each)
            spread = f"  rounds {min(each):.3f}..{max(each):.3f}" if len(each) > 1 else ""
        else:
            value, spread = self.median(top) / self.median(bottom), ""
        verdict = "" if target is None else f"  target >= {target}: {'met' if value >= target else 'BELOW TARGET'}"
        print(f"  {label:58s} {value:7.3f}{verdict}{spread}")

    def check(self, passed: bool, text: str) -> None:
        """Print ``text`` as a check's outcome; a failed one is recorded."""
        print(f"  {'ok  ' if passed else 'FAIL'} {text}")
        if not passed:
            self.failures.append(text)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Run a step; an exception ends it (printed and recorded as a failure), not the half."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 - one failed step must not lose the rest of a GPU run
            print(f"  FAIL {name}: {type(error).__name__}: {error}")
            print("".join(traceback.format_exc().splitlines(keepends=True)[-12:]), file=sys.stderr)
            self.failures.append(f"{name}: {type(error).__name__}: {error}")


def no_wait() -> None:
    """Nothing to wait for (a CPU, or a call that returns once its work is done)."""


def timed(run: Callable[[], Any], sync: Callable[[], None]) -> tuple[float, Any]:
    """Wall seconds of one call of ``run`` (``sync`` waits for the device before the clock stops), and its result."""
    began = time.perf_counter()
    result = run()
    sync()
    return time.perf_counter() - began, result


def median_call(run: Callable[[], Any], calls: int, sync: Callable[[], None]) -> float:
    """The median seconds of ``calls`` calls of ``run``."""
    return statistics.median(timed(run, sync)[0] for _ in range(calls))


def relative_row_error(rows: Any, reference: Any) -> float:
    """The largest ``|row - reference row| / |reference row|`` of two ``[tokens, hidden]`` tensors."""
    rows, reference = rows.float().cpu(), reference.float().cpu()
    if rows.shape != reference.shape:
        return float("inf")
    return float(((rows - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-12)).max())


# -- the torch half -----------------------------------------------------------------------------------------------


def torch_half(args: argparse.Namespace) -> Results:
    """Trace overhead and harvest throughput on transformers (see the module's docstring)."""
    import nnsight
    import torch
    import transformers
    from nnsight import TransformersModel
    from transformers import AutoModelForCausalLM

    from nnterp_vllm import StandardizedTransformer

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(
        f"torch half on {name}: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"nnsight {nnsight.__version__}, {str(dtype).removeprefix('torch.')}"
    )
    path = checkpoint(args)
    print(model_line(path))
    results = Results()
    loaded = {"dtype": dtype, "attn_implementation": "sdpa"}
    with results.step("loading the model three ways"):
        standardized = StandardizedTransformer(path, dispatch=True, **loaded).to(device)
        raw = TransformersModel(str(path), dispatch=True, task="text-generation", **loaded).to(device)
        plain = AutoModelForCausalLM.from_pretrained(path, **loaded).to(device).eval()
    if results.failures:
        return results
    sync = torch.cuda.synchronize if device.type == "cuda" else no_wait
    with results.step("trace overhead"):
        trace_overhead(args, standardized, raw, plain, results, sync)
    with results.step("harvest throughput"):
        harvest_throughput(args, standardized, plain, results, sync)
    return results


def trace_overhead(
    args: argparse.Namespace, standardized: Any, raw: Any, plain: Any, results: Results, sync: Callable[[], None]
) -> None:
    """StandardizedTransformer against raw nnsight and a plain forward, saving one block's output and every block's."""
    import torch

    sizes = scale(args)
    device = next(plain.parameters()).device
    ids = torch.tensor(random_rows(standardized.vocab_size, sizes.trace_batch, sizes.trace_tokens, 0), device=device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    middle = standardized.num_layers // 2
    native = [raw.get(block.path.split(".", 1)[1]) for block in standardized.layers]  # the same modules, raw

    def on_standardized(blocks: list[int]) -> Callable[[], list]:
        def run() -> list:
            saved = []
            with torch.no_grad(), standardized.trace(inputs, use_cache=False):
                for index in blocks:
                    saved.append(standardized.layers[index].layer_output.save())
            return saved

        return run

    def on_raw(blocks: list[int]) -> Callable[[], list]:
        def run() -> list:
            saved = []
            with torch.no_grad(), raw.trace(inputs, use_cache=False):
                for index in blocks:
                    saved.append(native[index].output.save())
            return saved

        return run

    def plain_forward() -> Any:
        with torch.no_grad():
            return plain(**inputs, use_cache=False, output_hidden_states=True).hidden_states

    every = list(range(standardized.num_layers))
    runs = {
        "plain forward, every hidden state": plain_forward,
        f"raw nnsight, block {middle}'s output": on_raw([middle]),
        f"StandardizedTransformer, layers[{middle}].layer_output": on_standardized([middle]),
        "raw nnsight, every block's output": on_raw(every),
        "StandardizedTransformer, every layer_output": on_standardized(every),
    }
    for run in runs.values():  # warm-up: compiles each trace's block, fills the allocator's caches
        run()
    sync()
    for _ in range(args.rounds):
        for label, run in runs.items():
            results.add(label, median_call(run, sizes.calls, sync))
    print(
        f"trace overhead: one batch of {sizes.trace_batch} x {sizes.trace_tokens} tokens, median of "
        f"{sizes.calls} calls per round, {args.rounds} alternating rounds"
    )
    for label in runs:
        print(f"  {label:58s} {results.median(label) * 1e3:9.2f} ms")
    print("  time ratios (median of the rounds'):")
    labels = list(runs)
    results.ratio("StandardizedTransformer / raw nnsight, one block", labels[2], labels[1])
    results.ratio("StandardizedTransformer / raw nnsight, every block", labels[4], labels[3])
    results.ratio("StandardizedTransformer, one block / plain forward", labels[2], labels[0])
    results.ratio("StandardizedTransformer, every block / plain forward", labels[4], labels[0])
    results.ratio("raw nnsight, every block / plain forward", labels[3], labels[0])


def harvest_throughput(
    args: argparse.Namespace, standardized: Any, plain: Any, results: Results, sync: Callable[[], None]
) -> None:
    """The harvest of every block's layer_output to disk against a plain forward over the same token batches."""
    import torch

    from nnterp_vllm import harvest

    sizes = scale(args)
    device = next(plain.parameters()).device
    bos = standardized.tokenizer.bos_token_id
    # Documents one BOS short of the context: each is exactly one row, as the plain forward's batches hold it.
    documents = random_rows(standardized.vocab_size, sizes.harvest_rows, sizes.harvest_tokens - (bos is not None), 1)
    rows = torch.tensor([([bos] if bos is not None else []) + document for document in documents])
    batches = [
        rows[start : start + sizes.harvest_batch].to(device) for start in range(0, len(rows), sizes.harvest_batch)
    ]
    base = plain.base_model
    tokens = rows.numel()

    def plain_forward() -> list:
        kept = []
        with torch.no_grad():
            for ids in batches:
                out = base(
                    input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, output_hidden_states=True
                )
                kept.append(out.hidden_states[1:])  # every block's output, kept on the device
        return kept

    scratch = Path(tempfile.mkdtemp(prefix="gpu-bench-harvest-"))

    def harvested() -> Any:
        out = scratch / "acts"
        shutil.rmtree(out, ignore_errors=True)  # a new harvest each time, never a resumed one
        with contextlib.redirect_stdout(io.StringIO()):  # its summary line
            return harvest(
                standardized,
                documents,
                [EVERY_BLOCK],
                out,
                engine="hf",
                context_length=sizes.harvest_tokens,
                batch_size=sizes.harvest_batch,
                progress=False,
            )

    try:
        reference = plain_forward()
        done = harvested()
        results.check(len(done) == tokens, f"the harvest kept {len(done)} tokens of {tokens}")
        error = relative_row_error(done.load("layers.0.layer_output")[: rows.shape[1]], reference[0][0][0])
        results.check(
            error <= HARVEST_TOLERANCE,
            f"harvested layers.0 rows against the plain forward's: worst relative error {error:.2e} "
            f"(<= {HARVEST_TOLERANCE})",
        )
        del reference, done
        for _ in range(args.rounds):
            results.add("plain", timed(plain_forward, sync)[0])
            results.add("harvest", timed(harvested, sync)[0])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"harvest: {sizes.harvest_rows} rows x {sizes.harvest_tokens} tokens, batches of {sizes.harvest_batch}, "
        f"every block's layer_output, {args.rounds} alternating rounds"
    )
    for key, label in (("plain", "plain forward, every hidden state (base model)"), ("harvest", "harvest to disk")):
        print(f"  {label:58s} {tokens / results.median(key):9.0f} tokens/s  {results.median(key):7.3f} s")
    results.ratio("harvest / plain forward, tokens/s", "plain", "harvest")


# -- the vLLM half ------------------------------------------------------------------------------------------------


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
    from nnterp_vllm.engines.vllm_platform import choose_model_runner

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


# -- running ------------------------------------------------------------------------------------------------------


def missing(part: str, args: argparse.Namespace) -> str | None:
    """Why ``part`` cannot run here, or None where it can."""
    needed = ("torch", "transformers", "nnsight") + (("vllm",) if part == "vllm" else ())
    absent = [name for name in needed if importlib.util.find_spec(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed"
    import torch

    if (part == "vllm" or args.device.startswith("cuda")) and not torch.cuda.is_available():
        return "CUDA is not available" + (" (the vLLM half runs vLLM's CUDA build on a GPU)" if part == "vllm" else "")
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=PARTS, help="run one half only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a 4-block model and small workloads: a quick check")
    parser.add_argument("--device", help="the torch half's device (default: cuda where available, else cpu)")
    parser.add_argument("--model", help="a checkpoint directory with its tokenizer (default: a random Llama)")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        args.device = "cuda" if importlib.util.find_spec("torch") and _cuda() else "cpu"
    if args.part:
        results = (torch_half if args.part == "torch" else vllm_half)(args)
        if results.failures:
            print(f"{args.part} half: {len(results.failures)} check(s) failed")
        sys.exit(1 if results.failures else 0)
    failed = False
    for part in [args.only] if args.only else PARTS:
        reason = missing(part, args)
        if reason:
            print(f"skipped the {part} half: {reason}", flush=True)
            continue
        # Each half in its own interpreter: vLLM and nnsight set process-wide state, and GPU memory is returned whole.
        command = [sys.executable, __file__, "--part", part, f"--rounds={args.rounds}", f"--device={args.device}"]
        command += ["--small"] * args.small + [f"--model={args.model}"] * bool(args.model)
        failed |= subprocess.run(command).returncode != 0
    sys.exit(1 if failed else 0)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
