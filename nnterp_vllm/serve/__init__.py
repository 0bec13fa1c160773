"""``nnterp-vllm serve``: vLLM's OpenAI-compatible server where every request may carry its own steering.

``nnterp-vllm serve MODEL [vLLM engine and server arguments] [--steering-vectors FILE] [--replicas N]``
takes every argument ``vllm serve`` takes (vLLM's own parser) and serves what ``vllm serve`` serves,
with the ``steering`` request field on ``/v1/completions`` and ``/v1/chat/completions`` and the vector
registry at ``/v1/steering/vectors`` (`server`). ``--replicas N`` runs N replicas behind one endpoint
on Ray Serve (`replicas`). Importing this package loads no vLLM; `main` does.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def prepare_ray_worker() -> None:
    """Ray's ``worker_process_setup_hook`` for ``--replicas``: importing ``nnterp_vllm`` is the preparation.

    A Ray worker unpickles the actor classes of a driver that has imported nnsight, which imports
    nnsight there before any of our code runs (anyio's attribute sets would then fail to define, see
    ``nnterp_vllm/__init__.py``); the hook runs first.
    """


#: Seconds a SIGTERM lets in-flight requests finish (vLLM's --shutdown-timeout, 0 there: abort at once).
DRAIN_SECONDS = 30
#: The name ``MODEL`` may be to serve the embedded default model (SmolLM2-135M-Instruct).
EMBEDDED_MODEL = "smollm2"

DESCRIPTION = """vLLM's OpenAI-compatible server (every `vllm serve` argument applies) where each request on
/v1/completions and /v1/chat/completions may carry `steering`: a list of specs {"layers": int | [int],
"vector": [float, ...] | "<registered name>", "factor": float, "positions": "all" | "prompt" | "generated"
| [int, ...]}. Vectors are registered at /v1/steering/vectors (POST, GET, DELETE) or preloaded with
--steering-vectors. MODEL is a checkpoint directory, a hub id, or 'smollm2' (the embedded default)."""


def parser() -> Any:
    """vLLM's ``serve`` argument parser (``make_arg_parser``) with the steering arguments added."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from ..engines.steered import ROWS_PER_REQUEST

    root = FlexibleArgumentParser(prog="nnterp-vllm serve", description=DESCRIPTION)
    root = make_arg_parser(root)
    steering = root.add_argument_group("Steering")
    steering.add_argument(
        "--steering-vectors",
        metavar="FILE",
        help="a safetensors file of named [hidden_size] vectors, registered at start under their names",
    )
    steering.add_argument(
        "--steering-rows-per-request",
        type=int,
        default=ROWS_PER_REQUEST,
        help="distinct sets of specs one request may apply to its tokens (sizes the engine's steering table)",
    )
    steering.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="N > 1: N replicas (one engine each) behind one endpoint, on Ray Serve; vectors are shared",
    )
    steering.add_argument("--ray-address", help="with --replicas: an existing Ray cluster (else a local one starts)")
    root.set_defaults(shutdown_timeout=DRAIN_SECONDS)
    return root


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed and checked as vLLM's serve checks it; the model named as vLLM's serve names it."""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    args = parser().parse_args(list(argv))
    if args.model_tag is not None:
        args.model = args.model_tag
    if args.model == EMBEDDED_MODEL:
        from ..checkpoints import smollm2

        args.model = str(smollm2())
        args.served_model_name = args.served_model_name or [EMBEDDED_MODEL]
    refused = {
        "--headless": args.headless,
        "--grpc": args.grpc,
        "--api-server-count": (args.api_server_count or 1) > 1,
        "--data-parallel-size": args.data_parallel_size > 1,
    }
    for flag, bad in refused.items():
        if bad:
            raise ValueError(f"{flag} is not served with steering: run one API server, and --replicas N to scale out")
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    validate_parsed_serve_args(args)
    return args


def main(argv: Sequence[str]) -> int:
    """Run the server until SIGTERM or SIGINT (in-flight requests drain for --shutdown-timeout seconds)."""
    import uvloop
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.usage.usage_lib import UsageContext

    from .fields import read_vectors_file
    from .registry import Registry, VectorRegistry
    from .server import engine_args, run_server

    cli_env_setup()
    args = parse(argv)
    configure_logging_from_args(args)
    arguments = engine_args(args)
    vllm_config = arguments.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    hidden_size = vllm_config.model_config.get_hidden_size()
    vectors = read_vectors_file(args.steering_vectors, hidden_size) if args.steering_vectors else {}
    if args.replicas > 1:
        from .replicas import run_replicas

        return run_replicas(args, list(argv), vectors)
    uvloop.run(run_server(args, Registry(VectorRegistry(vectors)), arguments, vllm_config))
    return 0
