"""The steering operation's own cost, per place it runs at, compiled on the CPU, in one process.

The steered engine runs its operation (`engines.steered.steering_table.SteeringTable.steered`, and the probe read at
each block) at every block's output, at what each attention and MLP adds and at the first block's input. This builds the
operation's buffers from the memory model at SmolLM2-135M's sizes (the engine's defaults: its pool, two direction
slots, the default probe columns), and compiles with ``torch.compile`` a stand-in forward of as many blocks (each
block its MLP's two matmuls, no attention) with and without the operation at each block's output and at what its
MLP adds (``--places all``) or at the blocks' outputs only (``blocks``), then times both on the same input: the
forward's time, the operation's per place, and their ratio, for a decode-sized step and a prefill-sized one.
Nothing is steered (every token reads entry 0), as in an unsteered step of a steered engine; the operation's cost
does not depend on what the entries hold. A quick, low-noise look at what ``benchmarks/steering.py
--compiled-only`` measures end to end; asserts nothing.

    python benchmarks/steering_operation.py [--tokens 64 1024] [--places all blocks] [--rounds 7]
"""

from __future__ import annotations

import argparse
import time

import torch

from nnterp_vllm.engines.steered.memory import (
    PROBE_COLUMNS,
    EngineSizes,
    Ledger,
    default_steering_entries,
    engine_buffers,
)
from nnterp_vllm.engines.steered.steering_table import SteeringTable

#: SmolLM2-135M's sizes.
LAYERS, HIDDEN, INTERMEDIATE = 30, 576, 1536


def table() -> SteeringTable:
    """The operation's buffers as the steered engine allocates them for SmolLM2-135M on the CPU."""
    sizes = EngineSizes(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        dtype=torch.float32,
        max_num_batched_tokens=4096,
        max_num_seqs=256,
        steering_entries=default_steering_entries(HIDDEN, torch.float32, 2),
        directions_per_block=2,
        kept_values=0,
        saes=(),
        accelerator=False,
        probe_columns=PROBE_COLUMNS,
    )
    return SteeringTable(Ledger(engine_buffers(sizes), "cpu"), {}, None)


def forward(steering: SteeringTable | None, places: str) -> torch.nn.Module:
    """The stand-in forward: ``LAYERS`` blocks, the operation where a steered engine runs it (``places``: ``all``
    or the blocks' outputs only), none where ``steering`` is None."""
    generator = torch.Generator().manual_seed(0)
    up = [torch.randn(HIDDEN, INTERMEDIATE, generator=generator) / HIDDEN**0.5 for _ in range(LAYERS)]
    down = [torch.randn(INTERMEDIATE, HIDDEN, generator=generator) / INTERMEDIATE**0.5 for _ in range(LAYERS)]

    def run(stream: torch.Tensor) -> torch.Tensor:
        for layer in range(LAYERS):
            added = torch.nn.functional.silu(stream @ up[layer]) @ down[layer]
            if steering is not None and places == "all":
                added = added + steering.steered(2 * LAYERS + layer, added)  # what the MLP adds
            stream = stream + added
            if steering is not None:
                steering.read_probes(layer, stream)
                stream = stream + steering.steered(layer, stream)  # the block's output
        return stream

    return run


def best_time(function, stream: torch.Tensor, rounds: int) -> float:
    for _ in range(3):
        function(stream)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(5):
            function(stream)
        best = min(best, (time.perf_counter() - start) / 5)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--places", nargs="+", default=["all", "blocks"], choices=["all", "blocks"])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    steering = table()
    for places in args.places:
        count = LAYERS * (2 if places == "all" else 1)
        plain = torch.compile(forward(None, places), dynamic=False)
        steered = torch.compile(forward(steering, places), dynamic=False)
        for tokens in args.tokens:
            stream = torch.randn(tokens, HIDDEN)
            without, with_operation = best_time(plain, stream, args.rounds), best_time(steered, stream, args.rounds)
            print(
                f"{tokens:5d} tokens, operation at {count} places ({places}): forward {without * 1e3:7.2f} ms, "
                f"with the operation {with_operation * 1e3:7.2f} ms ({without / with_operation:.3f}x), "
                f"{(with_operation - without) * 1e6 / count:6.1f} us per place",
                flush=True,
            )


if __name__ == "__main__":
    main()
