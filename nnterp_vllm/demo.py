"""The main job on the embedded default model: harvest SmolLM2-135M's residual stream over the shipped corpus.

``python -m nnterp_vllm.demo [OUT]`` (``make demo``) prepares the model, harvests every block's
``layer_output`` over ``nnterp_vllm/data/corpus.jsonl`` into OUT (``harvest-demo/`` by
default; rerunning resumes it) and prints where the activations are and how to load them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .checkpoints import smollm2
from .harvest import harvest

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.jsonl"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "harvest-demo")
    result = harvest(str(smollm2()), str(CORPUS), ["layers.*.layer_output"], out, context_length=128)
    first = next(iter(result))
    print(f"activations: {result.path.resolve()}")
    print(f"  {len(result)} tokens x {len(result.values)} values, in {len(result.shards)} shard(s), e.g.")
    resid, tokens = first["layers.10.layer_output"], first["token_ids"]
    print(f"  first shard: layers.10.layer_output {tuple(resid.shape)}, token_ids {tuple(tokens.shape)}")
    print("load them with:")
    print("  from nnterp_vllm import load_harvest")
    print(f"  harvest = load_harvest({str(result.path)!r})")
    print("  resid = harvest.load('layers.10.layer_output'); tokens = harvest.load('token_ids')")


if __name__ == "__main__":
    main()
