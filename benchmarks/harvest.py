"""Harvest throughput on SmolLM2-135M (CPU), every block's ``layer_output``, measured in one run.

(a) a plain transformers forward with ``output_hidden_states=True`` over the same batches (the
ceiling), (b) our harvest on transformers, (c) our harvest on vLLM; tokens/s (model loading
excluded) and peak RSS of each, each in its own process. The corpus: documents built from
the shipped corpus's sentences. Prints the numbers; asserts nothing.

    python benchmarks/harvest.py [--documents 240] [--context-length 128]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

CORPUS = Path(__file__).resolve().parent.parent / "nnterp_vllm" / "data" / "corpus.jsonl"
BATCH_SIZE = 8
SHARD_BYTES = 256 * 2**20


def build_corpus(path: Path, count: int) -> None:
    """``count`` documents of 2-6 sentences drawn, deterministically, from the shipped corpus."""
    sentences = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    with open(path, "w") as handle:
        for i in range(count):
            picks = [sentences[(i * 7 + j * 13) % len(sentences)] for j in range(2 + i % 5)]
            handle.write(json.dumps({"text": " ".join(picks)}) + "\n")


def plain_forward(checkpoint: str, corpus: Path, context_length: int) -> tuple[int, float]:
    """Tokens through a plain forward with output_hidden_states over the harvest's own batches; seconds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nnterp_vllm.harvest.corpus import ContextSettings, read_documents, rows
    from nnterp_vllm.harvest.run import batches, plan

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    began = time.perf_counter()
    settings = ContextSettings(context_length=context_length)
    per_token = model.config.num_hidden_layers * model.config.hidden_size * 4
    units = plan(rows(read_documents(str(corpus), settings=settings), tokenizer, settings), SHARD_BYTES // per_token)
    tokens = 0
    for unit in units:
        for _, ids, mask in batches(unit.rows, BATCH_SIZE, tokenizer.pad_token_id or 0):
            with torch.no_grad():
                hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            kept = [layer[mask.bool()].clone() for layer in hidden[1:]]  # what a harvest keeps: real tokens only
            tokens += int(mask.sum())
            del kept
    return tokens, time.perf_counter() - began


def our_harvest(checkpoint: str, corpus: Path, context_length: int, engine: str) -> tuple[int, float]:
    """Tokens harvested (every layer_output, to disk) by an already loaded model; seconds."""
    from nnterp_vllm.harvest import harvest
    from nnterp_vllm.harvest.run import load_model

    kwargs = {"dtype": "float32", "max_model_len": 512} if engine == "vllm" else {}
    model = load_model(checkpoint, engine, kwargs)
    out = Path(tempfile.mkdtemp(prefix=f"harvest-bench-{engine}-"))
    try:
        began = time.perf_counter()
        result = harvest(
            model,
            str(corpus),
            ["layers.*.layer_output"],
            out,
            context_length=context_length,
            batch_size=BATCH_SIZE,
            shard_bytes=SHARD_BYTES,
            progress=False,
        )
        return len(result), time.perf_counter() - began
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if engine == "vllm":
            model.shutdown()


def child(name: str, checkpoint: str, corpus: Path, context_length: int) -> None:
    if name == "plain":
        tokens, seconds = plain_forward(checkpoint, corpus, context_length)
    else:
        tokens, seconds = our_harvest(checkpoint, corpus, context_length, name)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tokens": tokens, "seconds": seconds, "peak_mib": peak}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=240)
    parser.add_argument("--context-length", type=int, default=128)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from nnterp_vllm.checkpoints import smollm2

    checkpoint = str(smollm2())
    if args.child:
        child(args.child, checkpoint, Path(args.corpus), args.context_length)
        return
    with tempfile.TemporaryDirectory() as scratch:
        corpus = Path(scratch) / "corpus.jsonl"
        build_corpus(corpus, args.documents)
        results = {}
        for name in ("plain", "transformers", "vllm"):
            command = [sys.executable, __file__, "--child", name, "--corpus", str(corpus)]
            command += [f"--context-length={args.context_length}"]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    rate = {name: result["tokens"] / result["seconds"] for name, result in results.items()}
    labels = {
        "plain": "(a) plain forward, output_hidden_states",
        "transformers": "(b) harvest on transformers",
        "vllm": "(c) harvest on vLLM",
    }
    print(f"SmolLM2-135M fp32, {args.documents} documents, context {args.context_length}, every layer_output")
    for name, result in results.items():
        peak, tokens = result["peak_mib"], result["tokens"]
        print(f"  {labels[name]:42s} {rate[name]:8.1f} tokens/s  peak RSS {peak:7.0f} MiB  ({tokens} tokens)")
    print(
        f"  (b)/(a) = {rate['transformers'] / rate['plain']:.3f}   (c)/(b) = {rate['vllm'] / rate['transformers']:.3f}"
    )


if __name__ == "__main__":
    main()
