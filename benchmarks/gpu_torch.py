"""The torch half of ``gpu.py``: trace overhead and harvest throughput on transformers."""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_measure import Results, median_call, no_wait, relative_row_error, timed
from gpu_model import EVERY_BLOCK, checkpoint, model_line, random_rows, scale

#: Relative error allowed between a harvested row and the plain forward's.
HARVEST_TOLERANCE = 0.02


def torch_half(args: argparse.Namespace) -> Results:
    """Trace overhead and harvest throughput on transformers (see ``gpu.py``'s docstring)."""
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
