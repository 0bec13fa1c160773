"""SAE features on the steered engine, SmolLM2-135M (fp32, CPU), every configuration measured in one run.

One `SteeredVLLM` holding a 4,608-feature SAE at block 6 (SAELens's standard SAE, its own initialisation, saved
by SAELens) runs a batch of prompts x new tokens (greedy, ``ignore_eos``), configurations in turn, ``--rounds``
times, each keeping its best: no capture; block 6's residual stream captured on every token; that SAE's features
captured on every token (each token's top 32, encoded on the worker from the rows the engine keeps); and one
feature clamped on every token (`Clamp`, the steering table's operation). Prints tokens/s and each ratio to the
run without capture or steering, wall clock and the process's CPU time; asserts nothing.

    python benchmarks/sae.py [--prompts 64] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
import time

from engines import MAX_MODEL_LEN, prompts

from nnterp_vllm.checkpoints import smollm2

LAYER, D_SAE = 6, 4608
KV_CACHE_BYTES = 512 * 2**20


def saelens_sae(directory: str) -> str:
    """A 4,608-feature standard SAE reading block 6's output, initialised and saved by SAELens."""
    from sae_lens import StandardSAE, StandardSAEConfig
    from sae_lens.saes.sae import SAEMetadata

    config = StandardSAEConfig(d_in=576, d_sae=D_SAE, metadata=SAEMetadata(hook_name=f"blocks.{LAYER}.hook_resid_post"))
    StandardSAE(config).save_model(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from vllm import SamplingParams

    from nnterp_vllm import SAE, Capture, Clamp, SteeredVLLM

    scratch = tempfile.mkdtemp(prefix="nnterp-vllm-sae-")
    atexit.register(shutil.rmtree, scratch, True)
    sae = SAE.load(saelens_sae(os.path.join(scratch, "sae")))
    llm = SteeredVLLM(
        smollm2(),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        capture_values=[f"layers.{LAYER}.layer_output"],
        saes=[sae],
    )
    batch = prompts(args.prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    configurations = {
        "no capture, no steering": {},
        f"layers.{LAYER}.layer_output captured": {"capture": Capture(f"layers.{LAYER}.layer_output")},
        "SAE features captured (top 32)": {"capture": Capture(f"layers.{LAYER}.sae_features", top_k=32)},
        "one SAE feature clamped": {"steering": Clamp(sae, 7, value=4.0)},
    }
    best: dict[str, tuple[float, float]] = {}
    try:
        llm.generate(batch, params, use_tqdm=False)  # warm-up
        for _ in range(args.rounds):
            for name, options in configurations.items():
                wall, cpu = time.perf_counter(), time.process_time()
                outputs = llm.generate(
                    batch, params, options.get("steering"), capture=options.get("capture"), use_tqdm=False
                )
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                tokens = sum(len(output.prompt_token_ids) + len(output.outputs[0].token_ids) for output in outputs)
                rate = (tokens / wall, tokens / cpu)
                best[name] = max(best.get(name, (0.0, 0.0)), rate)
                print(f"  {name}: {rate[0]:.1f} tok/s", flush=True)
    finally:
        llm.shutdown()
    base = best["no capture, no steering"]
    print(f"{args.prompts} prompts x {args.tokens} new tokens, best of {args.rounds} rounds (tokens through the model)")
    print(f"{'configuration':36s} {'tok/s':>9s} {'ratio':>7s} {'CPU ratio':>10s}")
    for name, (wall, cpu) in best.items():
        print(f"{name:36s} {wall:9.1f} {wall / base[0]:7.3f} {cpu / base[1]:10.3f}")
    captured = best[f"layers.{LAYER}.layer_output captured"]
    features = best["SAE features captured (top 32)"]
    print(
        f"SAE features against the block's stream alone: {features[0] / captured[0]:.3f} "
        f"(CPU {features[1] / captured[1]:.3f})"
    )


if __name__ == "__main__":
    main()
