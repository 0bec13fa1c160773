"""Harvest throughput on SmolLM2-135M (CPU, fp32), each measurement in its own process, in one run.

(a) the ceiling: a plain transformers forward of the base model (sdpa, no KV cache, no head)
    with ``output_hidden_states=True`` over the harvest's own rows, keeping every block's output;
(b) our harvest of all 30 ``layer_output`` s, to disk;
(c) our harvest of ``layers.3.layer_output`` only, against (c0) a plain forward of a 4-block model;
(d) SAELens's own activation caching (``CacheActivationsRunner``) of ``model.layers.3``, same
    model, corpus, context and batch size (its model and a local text dataset, offline);
(e) our harvest on vLLM through nnsight (a `StandardizedVLLM` passed in), all 30 ``layer_output`` s;
(f) our harvest on vLLM as it runs by default, the values kept inside the engine's compiled model, of all 30
    ``layer_output`` s and of ``layers.3.layer_output``, each by an engine built for it as the harvest builds
    one (the second runs 4 blocks), against (g) plain vLLM prefilling the same rows (``max_tokens=1``, its
    default compiled mode, the same scheduler settings), the ceiling;
and reading (b)'s harvest back with ``batches``: shuffled against sequential. (a)-(c) and (g)/(f) run in
alternating rounds (``--rounds``), so both sides of a ratio see the same load; the ratios are the
median of the rounds'.

Tokens/s and CPU time exclude model loading (CPU time: every thread of the process, the in-process engine's
included); peak RSS is the process's. The corpus: documents built from the shipped corpus's sentences,
packed into rows of exactly the context length (as SAELens does). Prints the numbers and ratios; asserts
nothing.

    python benchmarks/harvest.py [--documents 240] [--context-length 128] [--rounds 3] [--only plain-vllm,vllm,...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CORPUS = Path(__file__).resolve().parent.parent / "nnterp_vllm" / "data" / "corpus.jsonl"
BATCH_SIZE = 8
SHARD_BYTES = 256 * 2**20
SHALLOW = 3  # the block (c) and (d) read: layers.3.layer_output, SAELens's model.layers.3
READ_BATCH = 1024
#: Measured in alternating rounds: each ratio's two sides see the same load.
PAIRED = ("plain", "ours", "plain-4", "ours-3", "plain-vllm", "vllm")
#: Measured once, after the rounds.
ONCE = ("saelens", "vllm-nnsight", "read")


def cpu_seconds() -> float:
    """CPU time of this process so far, every thread's, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def packed_rows(checkpoint: str, corpus: Path, context_length: int) -> list[list[int]]:
    """The harvest's rows of the corpus: documents packed into rows of the context length."""
    from transformers import AutoTokenizer

    from nnterp_vllm.harvest.corpus import ContextSettings, read_documents, rows

    settings = ContextSettings(context_length=context_length, overflow="pack")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return [list(row.token_ids) for row in rows(read_documents(str(corpus), settings=settings), tokenizer, settings)]


def plain_vllm_prefill(checkpoint: str, corpus: Path, context_length: int) -> dict:
    """Plain vLLM (its default compiled mode, the harvest engine's scheduler settings) prefilling the harvest's
    rows, one token sampled each; tokens, seconds, CPU seconds."""
    from vllm import LLM, SamplingParams

    from nnterp_vllm.engines.vllm_platform import engine_kwargs, shutdown_llm
    from nnterp_vllm.harvest.in_engine import ENGINE_DEFAULTS

    prompts = [{"prompt_token_ids": ids} for ids in packed_rows(checkpoint, corpus, context_length)]
    llm = LLM(checkpoint, **engine_kwargs(checkpoint, dtype="float32", **ENGINE_DEFAULTS))
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        began, cpu = time.perf_counter(), cpu_seconds()
        llm.generate(prompts, params, use_tqdm=False)
        return measured(sum(len(prompt["prompt_token_ids"]) for prompt in prompts), began, cpu)
    finally:
        shutdown_llm(llm)


def build_corpus(path: Path, count: int) -> None:
    """``count`` documents of 2-6 sentences drawn, deterministically, from the shipped corpus."""
    sentences = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    with open(path, "w") as handle:
        for i in range(count):
            picks = [sentences[(i * 7 + j * 13) % len(sentences)] for j in range(2 + i % 5)]
            handle.write(json.dumps({"text": " ".join(picks)}) + "\n")


def measured(tokens: int, began: float, cpu: float, **more: object) -> dict:
    """A run's record: tokens, wall seconds and CPU seconds since ``began`` / ``cpu``, and ``more``."""
    return {"tokens": tokens, "seconds": time.perf_counter() - began, "cpu": cpu_seconds() - cpu, **more}


def plain_forward(checkpoint: str, corpus: Path, context_length: int, blocks: int | None) -> dict:
    """Tokens through the base model (``blocks`` of them, or all) over the harvest's rows, keeping every
    block's output for the real tokens; seconds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nnterp_vllm.harvest.compute import batches
    from nnterp_vllm.harvest.corpus import ContextSettings, read_documents, rows
    from nnterp_vllm.harvest.run import plan

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    extra = {} if blocks is None else {"num_hidden_layers": blocks}
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa", **extra).eval()
    base = model.model
    began, cpu = time.perf_counter(), cpu_seconds()
    settings = ContextSettings(context_length=context_length, overflow="pack")
    per_token = model.config.num_hidden_layers * model.config.hidden_size * 4
    units = plan(rows(read_documents(str(corpus), settings=settings), tokenizer, settings), SHARD_BYTES // per_token)
    tokens = 0
    for unit in units:
        for _, ids, mask in batches(unit.rows, BATCH_SIZE, tokenizer.pad_token_id or 0):
            with torch.no_grad():
                hidden = base(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
            kept = [layer[mask.bool()].clone() for layer in hidden.hidden_states[1:]]  # what a harvest keeps
            tokens += int(mask.sum())
            del kept
    return measured(tokens, began, cpu)


def our_harvest(
    checkpoint: str,
    corpus: Path,
    context_length: int,
    engine: str,
    selections: list[list[str]],
    out: Path,
    through_nnsight: bool = False,
):
    """Per selection: tokens harvested to disk (a directory under ``out``) by a model built for it as the
    harvest builds one (`build_settings`: attention on transformers, the blocks run and the in-engine path on
    vLLM; a `StandardizedVLLM` where ``through_nnsight``); seconds and CPU seconds, model loading excluded;
    the attention used; the blocks each forward ran; the vLLM path."""
    from nnterp_vllm.harvest import harvest
    from nnterp_vllm.harvest.compute import build_settings, load_model
    from nnterp_vllm.harvest.in_engine import CAPTURE_VALUES, ENGINE_DEFAULTS, EngineHarvester
    from nnterp_vllm.harvest.selection import check_selectors

    results = []
    for number, values in enumerate(selections):
        given = {"dtype": "float32"} if engine == "vllm" else {}
        settings = build_settings(check_selectors(values, context_length), engine, given)
        if through_nnsight:
            settings = {name: value for name, value in settings.items() if name not in ENGINE_DEFAULTS}
            settings.pop(CAPTURE_VALUES, None)
        model = load_model(checkpoint, engine, settings)
        try:
            began, cpu = time.perf_counter(), cpu_seconds()
            result = harvest(
                model.llm if isinstance(model, EngineHarvester) else model,  # a SteeredVLLM, as a user passes one
                str(corpus),
                values,
                out if number == 0 else out.with_name(f"{out.name}-{number}"),
                context_length=context_length,
                overflow="pack",
                batch_size=BATCH_SIZE,
                shard_bytes=SHARD_BYTES,
                progress=False,
            )
            run = measured(len(result), began, cpu)
        finally:
            if engine == "vllm":
                model.shutdown()
        manifest = result.manifest
        results.append({**run, "note": f"attention {manifest['attention']}, {manifest['blocks_run']} blocks"})
        if manifest.get("vllm_path"):
            results[-1]["note"] += f", path {manifest['vllm_path']}"
    return results


def saelens_caching(checkpoint: str, corpus: Path, context_length: int, tokens: int, out: Path) -> dict:
    """SAELens's CacheActivationsRunner over the same text, model, block and context; tokens cached, seconds."""
    from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig

    text = out.with_name("saelens-text")
    text.mkdir()
    shutil.copy(corpus, text / "train.jsonl")
    batch = BATCH_SIZE * context_length
    per_buffer = max(batch, tokens // 2 // batch * batch)  # two buffers, whole batches each
    tokens = 2 * per_buffer
    config = CacheActivationsRunnerConfig(
        dataset_path=str(text),
        model_name=checkpoint,
        model_class_name="AutoModelForCausalLM",
        model_batch_size=BATCH_SIZE,
        hook_name=f"model.layers.{SHALLOW}",
        d_in=576,
        training_tokens=tokens,
        context_size=context_length,
        new_cached_activations_path=str(out),
        shuffle=False,
        dtype="float32",
        device="cpu",
        buffer_size_gb=(per_buffer + 0.5) * 576 * 4 / 1e9,
        streaming=False,
        prepend_bos=True,
    )
    runner = CacheActivationsRunner(config)
    began, cpu = time.perf_counter(), cpu_seconds()
    dataset = runner.run()
    return measured(len(dataset) * context_length, began, cpu)


def read_back(out: Path, rounds: int = 9) -> dict[str, float]:
    """Tokens/s of one epoch of `Harvest.batches` over every value of a harvest, sequential and shuffled,
    in ``rounds`` rounds of one pass each after a pass that brings the files into the page cache: the best
    pass of each, and the median of the rounds' shuffled/sequential ratios (each round's two passes run
    back to back, so they see the same load)."""
    from nnterp_vllm import load_harvest

    harvest = load_harvest(out)

    def rate(shuffle: bool) -> float:
        began = time.perf_counter()
        tokens = sum(len(next(iter(batch.values()))) for batch in harvest.batches(READ_BATCH, shuffle=shuffle))
        return tokens / (time.perf_counter() - began)

    rate(False)
    passes = [(rate(False), rate(True)) for _ in range(rounds)]
    return {
        "sequential": max(sequential for sequential, _ in passes),
        "shuffled": max(shuffled for _, shuffled in passes),
        "median ratio": statistics.median(shuffled / sequential for sequential, shuffled in passes),
    }


def child(name: str, checkpoint: str, corpus: Path, context_length: int, scratch: Path, tokens: int) -> dict:
    everything, shallow = ["layers.*.layer_output"], [f"layers.{SHALLOW}.layer_output"]
    if name == "plain":
        done = {"runs": [plain_forward(checkpoint, corpus, context_length, None)]}
    elif name == "plain-4":
        done = {"runs": [plain_forward(checkpoint, corpus, context_length, SHALLOW + 1)]}
    elif name in ("ours", "ours-3"):
        selection, out = ([everything], scratch / "all") if name == "ours" else ([shallow], scratch / "three")
        shutil.rmtree(out, ignore_errors=True)  # a new harvest each round, not a resumed one
        done = {"runs": our_harvest(checkpoint, corpus, context_length, "transformers", selection, out)}
    elif name == "saelens":
        done = {"runs": [saelens_caching(checkpoint, corpus, context_length, tokens, scratch / "saelens")]}
    elif name == "vllm":
        shutil.rmtree(scratch / "vllm", ignore_errors=True)
        shutil.rmtree(scratch / "vllm-1", ignore_errors=True)
        done = {
            "runs": our_harvest(checkpoint, corpus, context_length, "vllm", [everything, shallow], scratch / "vllm")
        }
    elif name == "plain-vllm":
        done = {"runs": [plain_vllm_prefill(checkpoint, corpus, context_length)]}
    elif name == "vllm-nnsight":
        out = scratch / "vllm-nnsight"
        done = {
            "runs": our_harvest(checkpoint, corpus, context_length, "vllm", [everything], out, through_nnsight=True)
        }
    else:
        done = {"read": read_back(scratch / "all")}
    done["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=240)
    parser.add_argument("--context-length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of (a), (b), (c0), (c), (g), (f)")
    parser.add_argument(
        "--only",
        help="measure only these, comma-separated: " + ", ".join([*PAIRED, *ONCE]),
        type=lambda text: text.split(","),
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from nnterp_vllm.checkpoints import smollm2

    checkpoint = str(smollm2())
    if args.child:
        scratch = Path(args.scratch)
        print(
            json.dumps(
                child(args.child, checkpoint, scratch / "corpus.jsonl", args.context_length, scratch, args.tokens)
            )
        )
        return
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="harvest-bench-") as scratch:
        build_corpus(Path(scratch) / "corpus.jsonl", args.documents)
        tokens = 0
        for name in [*PAIRED * args.rounds, *ONCE]:
            if args.only and name not in args.only:
                continue
            command = [sys.executable, __file__, "--child", name, "--scratch", scratch, f"--tokens={tokens}"]
            command += [f"--context-length={args.context_length}"]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"  {name}: failed\n{done.stderr[-3000:]}")
                continue
            results.setdefault(name, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
            tokens = tokens or results[name][0]["runs"][0]["tokens"]
    report(results, args)


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    """Per measurement its median over the rounds; per ratio the median of the rounds' ratios, with their range."""
    rates: dict[str, list[float]] = {}
    seconds: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    labels = {
        "plain": "(a) plain forward, base model, all hidden states",
        "ours": "(b) our harvest, all 30 layer_outputs",
        "plain-4": "(c0) plain forward of 4 blocks",
        "ours-3": f"(c) our harvest, layers.{SHALLOW}.layer_output",
        "saelens": f"(d) SAELens CacheActivationsRunner, model.layers.{SHALLOW}",
        "vllm-nnsight": "(e) our harvest on vLLM through nnsight, all 30",
        "plain-vllm": "(g) plain vLLM prefill of the same rows",
        "vllm": "(f) our harvest on vLLM in the engine, all 30",
        "vllm-3": f"(f3) our harvest on vLLM in the engine, layers.{SHALLOW}",
    }
    print(
        f"SmolLM2-135M fp32, {args.documents} documents packed into rows of {args.context_length}, batch {BATCH_SIZE}; "
        f"(a)-(c), (f), (g) in {args.rounds} alternating rounds, medians shown"
    )
    for name, rounds in results.items():
        for index in range(len(rounds[0].get("runs", []))):
            key = name if index == 0 else f"{name}-3"
            runs = [result["runs"][index] for result in rounds]
            rates[key] = [run["tokens"] / run["seconds"] for run in runs]
            seconds[key] = [run["seconds"] for run in runs]
            cpu[key] = [run["cpu"] / run["tokens"] * 1000 for run in runs]
            peak = max(result["peak_mib"] for result in rounds)
            print(
                f"  {labels[key]:54s} {statistics.median(rates[key]):8.1f} tokens/s  "
                f"{statistics.median(seconds[key]):6.1f} s  CPU {statistics.median(cpu[key]):5.2f} s/1k tokens  "
                f"peak RSS {peak:6.0f} MiB  ({runs[0]['tokens']} tokens)  {runs[0].get('note', '')}"
            )
    if "read" in results:
        read, peak = results["read"][0]["read"], results["read"][0]["peak_mib"]
        print(
            f"  reading (b) back, batches of {READ_BATCH}, every value, the default 256 MiB window, best of 9 "
            f"(peak RSS {peak:.0f} MiB):"
        )
        for name in ("sequential", "shuffled"):
            print(f"    {name:18s} {read[name]:10.0f} tokens/s")
    print("ratios (goal):")

    def ratio(text: str, top: str, bottom: str, goal: str, by: dict = rates) -> None:
        if top in by and bottom in by:
            each = [a / b for a, b in zip(by[top], by[bottom])]
            spread = f"  rounds {min(each):.3f}..{max(each):.3f}" if len(each) > 1 else ""
            print(f"  {text:50s} {statistics.median(each):6.3f}   ({goal}){spread}")

    ratio("(b)/(a) tokens/s", "ours", "plain", ">= 0.95")
    ratio("(c) time / (c0) time", "ours-3", "plain-4", "<= 1.2", by=seconds)
    ratio("(c)/(d) tokens/s", "ours-3", "saelens", ">= 1")
    ratio("(c)/(b) tokens/s: cost falls with depth", "ours-3", "ours", "> 1")
    ratio("(f)/(g) tokens/s (wall)", "vllm", "plain-vllm", ">= 0.9")
    ratio("(g)/(f) CPU time per token", "plain-vllm", "vllm", ">= 0.9", by=cpu)
    ratio("(f3)/(g) tokens/s: 4 blocks against the whole model", "vllm-3", "plain-vllm", ">= 4")
    ratio("(f)/(b) tokens/s: vLLM against transformers", "vllm", "ours", ">= 3")
    ratio("(f)/(e) tokens/s: in the engine against nnsight", "vllm", "vllm-nnsight", "")
    if "read" in results:
        read = results["read"][0]["read"]
        print(
            f"  {'shuffled / sequential read, best passes':50s} {read['shuffled'] / read['sequential']:6.3f}   (>= 0.8)"
        )
        print(f"  {'shuffled / sequential read, median round':50s} {read['median ratio']:6.3f}   (>= 0.8)")


if __name__ == "__main__":
    main()
