"""``nnterp-vllm``: the command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any


def _support(args: argparse.Namespace) -> int:
    from .engines.transformers import StandardizedTransformer

    model = StandardizedTransformer(args.model)
    print(json.dumps({"family": model.family.__name__.rsplit(".", 1)[-1], **model.support()}, indent=2))
    return 0


def probes_given(given: Sequence[str] | None) -> dict[str, Any] | None:
    """``--probe NAME=PATH@LAYER[:ACTIVATION]`` arguments as probes by name (`specs.probes.Probe`, from a
    safetensors file holding one tensor, or ``weight`` and ``bias``); ValueError naming a malformed one."""
    if not given:
        return None
    from .specs.probes import Probe

    probes = {}
    for text in given:
        name, equals, rest = text.partition("=")
        path, at, read = rest.rpartition("@")
        layer, _, activation = read.partition(":")
        if not (name and equals and path and at) or not layer.removeprefix("-").isdigit():
            raise ValueError(f"--probe takes NAME=PATH.safetensors@LAYER (or @LAYER:sigmoid, :softmax), got {text!r}")
        if name in probes:
            raise ValueError(f"--probe names {name!r} twice")
        probes[name] = Probe(path, layer=int(layer), activation=activation or None)
    return probes


def _harvest(args: argparse.Namespace) -> int:
    from . import dtypes
    from .checkpoints import named
    from .harvest.run import harvest

    model = named(args.model)
    engine = "vllm" if args.engine == "vllm" else "transformers"
    model_kwargs = {"dtype": args.model_dtype} if args.model_dtype else {}
    dtypes.requested(args.model_dtype, engine, "--model-dtype")
    if args.tensor_parallel_size is not None:
        if args.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
        # vLLM splits each replica itself; transformers splits over the processes torchrun started.
        if args.engine == "vllm":
            model_kwargs["tensor_parallel_size"] = args.tensor_parallel_size
        elif args.tensor_parallel_size > 1:
            model_kwargs["tp_size"] = args.tensor_parallel_size
    # What the harvest and its plan both take.
    common = {
        "engine": args.engine,
        "format": args.format,
        "positions": args.positions,
        "context_length": args.context_length,
        "overflow": args.overflow,
        "add_bos": not args.no_bos,
        "text_field": args.text_field,
        "dtype": args.dtype,
        "model_kwargs": model_kwargs,
        "probes": probes_given(args.probe),
    }
    if args.plan:
        from .harvest.plan import describe, plan

        print(describe(plan(model, args.corpus, args.values, tokens_per_second=args.tokens_per_second, **common)))
        return 0
    result = harvest(
        model,
        args.corpus,
        args.values,
        args.out,
        batch_size=args.batch_size,
        shard_bytes=int(args.shard_mb * 2**20),
        overwrite=args.overwrite,
        workers=args.workers,
        ray_address=args.ray_address,
        progress=not args.quiet,
        shared_filesystem=args.shared_filesystem,
        **common,
    )
    print(f"activations: {result.path} ({len(result)} tokens, {len(result.shards)} shards, values {result.values})")
    print(f"load them with: from nnterp_vllm import load_harvest; harvest = load_harvest({str(result.path)!r})")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from .checkpoints import named
    from .steering.sweeps import read_grid, run_grid

    table = run_grid(named(args.model), read_grid(args.grid), progress=not args.quiet)
    print(f"{len(table)} rows written to {table.to_jsonl(args.out)}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .serve import main

    return main(args.arguments)


def _plan(args: argparse.Namespace) -> int:
    from .engines.steered.planning import plan, printed

    made = plan(
        args.model,
        args.device,
        args.tensor_parallel_size,
        server=args.server,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_steering_entries=args.max_steering_entries,
        directions_per_block=args.steering_directions_per_block,
        capture_values=args.capture_values,
        saes=args.sae or (),
    )
    print(json.dumps(made.as_dict(), indent=2) if args.json else printed(made))
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from .checkpoints import smollm2

    print(smollm2())
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    root = argparse.ArgumentParser(prog="nnterp-vllm", description=__doc__)
    commands = root.add_subparsers(dest="command", required=True)
    support = commands.add_parser("support", help="print which standardized values a model has, and why not")
    support.add_argument("model", help="a checkpoint directory or hub id")
    support.set_defaults(run=_support)
    harvest = commands.add_parser("harvest", help="harvest activations over a corpus to disk (resumable)")
    harvest.add_argument("model", help="a checkpoint directory or hub id, or 'smollm2' for the embedded default model")
    harvest.add_argument(
        "--corpus", required=True, help=".txt (a document per line), a directory, .jsonl or a saved dataset"
    )
    harvest.add_argument(
        "--values", required=True, nargs="+", help="e.g. 'layers.*.layer_output' 'layers.6.mlp_output'"
    )
    harvest.add_argument(
        "--out",
        required=True,
        help="output directory, or any fsspec URL (s3://bucket/run, gs://, az://, file://); rerunning resumes it",
    )
    harvest.add_argument(
        "--probe",
        action="append",
        metavar="NAME=PATH@LAYER[:ACTIVATION]",
        help="a linear probe (a safetensors file) read at block LAYER, harvested as the value probes.NAME; "
        "ACTIVATION: sigmoid or softmax",
    )
    harvest.add_argument("--engine", choices=["hf", "transformers", "vllm"], default="transformers")
    harvest.add_argument(
        "--format",
        choices=["safetensors", "sae-lens"],
        default="safetensors",
        help="safetensors shards, or a dataset SAELens's cached-activation training reads as it is",
    )
    harvest.add_argument("--workers", type=int, default=1, help="Ray actors, one model replica each")
    harvest.add_argument("--ray-address", help="an existing Ray cluster (a local one is started otherwise)")
    harvest.add_argument(
        "--tensor-parallel-size",
        type=int,
        help="ranks each model is split over: vLLM's tensor_parallel_size (per replica with --workers); "
        "on transformers, under `torchrun --nproc-per-node T`",
    )
    harvest.add_argument("--positions", choices=["all", "last"], default="all")
    harvest.add_argument("--context-length", type=int, help="tokens per row (default: whole documents)")
    harvest.add_argument(
        "--overflow",
        choices=["truncate", "split", "pack"],
        help="what a document longer than the context becomes (default: truncate; pack for --format sae-lens)",
    )
    harvest.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token to each document")
    harvest.add_argument("--text-field", default="text", help="the JSONL / dataset field holding the text")
    harvest.add_argument("--batch-size", type=int, default=8, help="rows per forward on transformers")
    harvest.add_argument("--shard-mb", type=float, default=256.0, help="approximate size of a shard")
    harvest.add_argument("--dtype", help="dtype the activations are stored in (default: the model's)")
    harvest.add_argument(
        "--model-dtype",
        help="dtype to load the model in (default: the checkpoint's own, the same on both engines)",
    )
    harvest.add_argument("--overwrite", action="store_true", help="replace a directory made with other settings")
    harvest.add_argument("--quiet", action="store_true", help="no progress bar")
    harvest.add_argument(
        "--shared-filesystem",
        action="store_true",
        help="a local --out is a file system every Ray node mounts at the same path (else refused on several nodes)",
    )
    harvest.add_argument(
        "--plan",
        action="store_true",
        help="print bytes per token, the run's size and the write bandwidth needed; start no engine",
    )
    harvest.add_argument(
        "--tokens-per-second", type=float, help="with --plan: the engine's tokens/s (a harvest's summary line shows it)"
    )
    harvest.set_defaults(run=_harvest)
    sweep = commands.add_parser(
        "sweep", help="run a steering grid (vectors x layers x factors x prompts) as one batch; rows to JSON lines"
    )
    sweep.add_argument("model", help="a checkpoint directory or hub id, or 'smollm2' for the embedded default model")
    sweep.add_argument("--grid", required=True, help="a YAML or JSON file: prompts, vectors, layers, factors, ...")
    sweep.add_argument("--out", required=True, help="the JSON-lines file of rows to write")
    sweep.add_argument("--quiet", action="store_true", help="no progress bar")
    sweep.set_defaults(run=_sweep)
    serve = commands.add_parser(
        "serve",
        help="vLLM's OpenAI-compatible server with per-request steering (nnterp-vllm serve MODEL --help)",
        add_help=False,
        prefix_chars="+",  # every argument, --help included, is vLLM's serve parser's (serve.command_line.parser)
    )
    serve.add_argument("arguments", nargs=argparse.REMAINDER)
    serve.set_defaults(run=_serve)
    planned = commands.add_parser(
        "plan",
        help="what a steered engine of a model takes of a GPU, per rank, beside vLLM's KV cache (reads its config)",
    )
    planned.add_argument("model", help="a hub id, a checkpoint directory or a config.json")
    planned.add_argument("--device", default="h100", help="h100 (default), h200, a100-80g or b200")
    planned.add_argument("--tensor-parallel-size", type=int, default=1)
    planned.add_argument("--server", action="store_true", help="vLLM's defaults for its OpenAI server, not for LLM")
    planned.add_argument("--dtype", help="the dtype the model runs in (default: the checkpoint's own)")
    planned.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    planned.add_argument("--max-num-batched-tokens", type=int, help="default: vLLM's for the device")
    planned.add_argument("--max-num-seqs", type=int, help="default: vLLM's for the device")
    planned.add_argument("--max-steering-entries", type=int, help="the steering pool's size (default: the model's)")
    planned.add_argument("--steering-directions-per-block", type=int, help="direction slots per entry (default: 2)")
    planned.add_argument("--capture-values", nargs="+", metavar="SELECTOR", help="values requests may capture")
    planned.add_argument("--sae", nargs="+", metavar="DIR", help="SAELens SAE directories the engine holds")
    planned.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    planned.set_defaults(run=_plan)
    prepare = commands.add_parser(
        "prepare", help="prepare the embedded default model (SmolLM2-135M) and print its path"
    )
    prepare.set_defaults(run=_prepare)
    return root


def one_line(error: BaseException) -> str:
    """An error's message on one line (a multi-line message's lines joined with '; ')."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines).replace(":; ", ": ") or type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (``sys.argv[1:]`` by default).

    A refusal (bad input, an unreadable file, a harvest that cannot go on) prints one line,
    ``nnterp-vllm: error: ...``, and exits with status 2; an interrupt exits with 130.
    """
    args = parser().parse_args(argv)
    from .errors import UnavailableValue, UnsupportedFamily
    from .harvest import HarvestError

    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("nnterp-vllm: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except (HarvestError, OSError, ValueError, TypeError, UnavailableValue, UnsupportedFamily) as error:
        print(f"nnterp-vllm: error: {one_line(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
