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
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from gpu_torch import torch_half
from gpu_vllm import vllm_half

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the package of this checkout, whether or not it is installed
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model is a local directory
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PARTS = ("torch", "vllm")


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
