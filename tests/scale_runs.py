"""Runs tests/test_scale.py starts as processes of their own (under torchrun, in a private mount namespace).

torchrun --nproc-per-node 2 tests/scale_runs.py values OUT      each rank saves `read_everything` to OUT/rank<r>.pt
torchrun --nproc-per-node 2 tests/scale_runs.py harvest OUT     each rank runs the same harvest into OUT/acts
python tests/scale_runs.py leftovers                            files left by a TP=2 engine, a Ray-executor engine
                                                                and a two-replica vLLM harvest, one JSON line
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402

PROMPT = "Hello world, the tower"
#: Per block, in forward order: every value the tensor-parallel runs are compared on.
BLOCK_VALUES = (
    "layer_input",
    "self_attn.attention_input",
    "self_attn.attention_queries",
    "self_attn.attention_keys",
    "self_attn.attention_values",
    "self_attn.attention_scores",
    "self_attn.attention_probabilities",
    "self_attn.attention_premix",
    "self_attn.attention_head_outputs",
    "attention_output",
    "mlp.mlp_input",
    "mlp_output",
    "layer_output",
)
DOCUMENTS = [
    "The Eiffel Tower is in Paris.",
    "Water boils at one hundred degrees Celsius.",
    "A third document, longer than the other two by a few words.",
] * 3


def value(host, name: str):
    """``host``'s value at a dotted ``name`` (``self_attn.attention_queries``)."""
    *path, last = name.split(".")
    for part in path:
        host = getattr(host, part)
    return getattr(host, last)


def read_everything(model) -> dict:
    """Every block value and the logits; then the logits after writes (an in-place edit of the queries, values
    assigned, a steer, skipped block), after head outputs written doubled, and the logit lens."""
    got = {}
    with model.trace(PROMPT):
        for index, block in enumerate(model.layers):
            for name in BLOCK_VALUES:
                got[f"{index}.{name}"] = value(block, name).save()
        got["logits"] = model.logits.save()
    with model.trace(PROMPT):
        attention = model.layers[1].self_attn
        queries = attention.attention_queries
        queries[:, 0] = 0
        attention.attention_values = torch.zeros_like(attention.attention_values)
        model.steer(1, torch.ones(model.hidden_size), factor=0.5)
        model.skip_layers(2, 2)
        got["edited logits"] = model.logits.save()
    with model.trace(PROMPT):
        attention = model.layers[0].self_attn
        attention.attention_head_outputs = attention.attention_head_outputs * 2
        got["doubled heads logits"] = model.logits.save()
    got["logit lens"] = model.logit_lens(PROMPT)
    return {name: tensor.detach().clone() for name, tensor in got.items()}


def harvest_into(out: Path, **model_kwargs):
    from nnterp_vllm import harvest

    return harvest(
        str(tiny.checkpoint("llama")),
        DOCUMENTS,
        ["layers.*.layer_output", "layers.1.self_attn.attention_queries"],
        out,
        shard_bytes=30_000,
        progress=False,
        model_kwargs=model_kwargs,
    )


def _values(out: Path) -> None:
    from nnterp_vllm import StandardizedTransformer

    rank = int(os.environ["RANK"])
    model = StandardizedTransformer(tiny.checkpoint("llama"), tp_plan="auto")
    torch.save(read_everything(model), out / f"rank{rank}.pt")


def _harvest(out: Path) -> None:
    rank = int(os.environ["RANK"])
    acts = harvest_into(out / "acts", tp_size=2)
    (out / f"rank{rank}.json").write_text(json.dumps({"tokens": len(acts), "shards": len(acts.shards)}))


def entries() -> set[str]:
    """What /dev/shm and /tmp hold, but torch's compile cache (kept across runs by design, as under ~/.cache)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    found = {f"/dev/shm/{name}" for name in os.listdir("/dev/shm")} | {f"/tmp/{name}" for name in os.listdir("/tmp")}
    return found - {default_cache_dir()}


def _leftovers() -> None:
    """Each run, then what it left in /dev/shm and /tmp (a private namespace's, where the test can make one),
    printed as one JSON line."""
    import tempfile

    from nnterp_vllm import StandardizedVLLM

    path = tiny.checkpoint("llama")
    work = Path(tempfile.mkdtemp(prefix="scale-leftovers-"))
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
    left: dict[str, list[str]] = {}
    for name, kwargs in (("tp2-mp", {}), ("tp2-ray", {"distributed_executor_backend": "ray"})):
        before = entries()
        model = StandardizedVLLM(path, dtype="float32", tensor_parallel_size=2, dispatch=True, **kwargs)
        with model.trace(PROMPT):
            model.layers[1].layer_output.save()
        model.shutdown()
        time.sleep(1)
        left[name] = sorted(entries() - before)
    before = entries()
    command = [sys.executable, "-m", "nnterp_vllm.cli", "harvest", str(path), "--corpus", str(corpus)]
    command += ["--values", "layers.1.layer_output", "--out", str(work / "acts"), "--engine", "vllm"]
    command += ["--workers", "2", "--model-dtype", "float32", "--shard-mb", "0.03", "--quiet"]
    subprocess.run(command, check=True)
    time.sleep(1)
    left["workers2-vllm"] = sorted(entries() - before)
    print("LEFTOVERS " + json.dumps(left))


if __name__ == "__main__":
    if sys.argv[1] == "leftovers":
        _leftovers()
    else:
        {"values": _values, "harvest": _harvest}[sys.argv[1]](Path(sys.argv[2]))
