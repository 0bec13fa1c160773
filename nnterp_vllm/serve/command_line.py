"""``nnterp-vllm serve``'s command line: vLLM's ``serve`` parser with the steering arguments, read and checked as
vLLM's serve checks it (`parse`). Importing this module loads no vLLM."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

from ..checkpoints import EMBEDDED, named

#: Seconds a SIGTERM lets in-flight requests finish (vLLM's --shutdown-timeout, 0 there: abort at once).
DRAIN_SECONDS = 30

DESCRIPTION = """vLLM's OpenAI-compatible server (every `vllm serve` argument applies) where each request on
/v1/completions, /v1/chat/completions, /v1/chat/completions/batch, /v1/messages, /v1/responses and /invocations
may carry `steering`: a list of specs {"kind": "add" | "ablate" | "cap", "layers": int | [int],
"vector": [float, ...] | "<registered name>", "factor": float (add), "scale": "absolute" | "relative" (add:
the factor a fraction of the stream's norm where relative), "min"/"max": float (cap),
"positions": "all" | "prompt" | "generated" | [int, ...]}, or {"kind": "clamp", "sae": "<name>", "feature": int,
"value" | "scale": float, "positions"} (an SAE registered with --sae). Vectors are registered at
/v1/steering/vectors (POST, GET, DELETE) or preloaded with --steering-vectors. A steered model
(--steered-model NAME=RECIPE, or POST /v1/steering/models) is a name a request sends as its model to be steered by
the name's recipe, for clients that cannot send steering (evaluation harnesses). GET /playground tries steering in a
browser. With --traces, nnsight traces sent with model.trace(..., serve=URL, api_key=KEY) run too. MODEL is a
checkpoint directory, a hub id, or 'smollm2' (the embedded default)."""


def parser() -> Any:
    """vLLM's ``serve`` argument parser (``make_arg_parser``) with the steering arguments added."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from ..engines.steered.memory import PROBE_COLUMNS
    from ..specs.steering_requests import DIRECTIONS_PER_BLOCK
    from .capture_field import MAX_CAPTURE_BYTES
    from .registry import CAPACITY
    from .traces import add_arguments as add_trace_arguments

    root = FlexibleArgumentParser(prog="nnterp-vllm serve", description=DESCRIPTION)
    root = make_arg_parser(root)
    steering = root.add_argument_group("Steering")
    steering.add_argument(
        "--steering-vectors",
        metavar="SOURCE",
        nargs="+",
        help="vectors registered at start: a safetensors file of named [hidden_size] vectors (each under its "
        "name), or [NAME=]FILE[#FEATURE], a vector made elsewhere (a repeng .gguf, a steering-vectors dict saved "
        "with torch.save or as safetensors, a SAELens directory and its feature) registered per layer under NAME",
    )
    steering.add_argument(
        "--steered-model",
        metavar="NAME=RECIPE",
        nargs="+",
        help="steered models: a request naming NAME as its model is the base model steered by RECIPE (listed in "
        "/v1/models with the base model as parent); RECIPE is VECTOR@LAYER[:FACTOR] or VECTOR@FIRST-LAST[:FACTOR] "
        "for a registered vector (several joined by '+'), or a .json/.yaml file of specs in the steering field's "
        "format; more are registered at /v1/steering/models",
    )
    steering.add_argument(
        "--sae",
        metavar="NAME=DIR",
        nargs="+",
        help="SAEs the engine holds, each a SAELens SAE directory under NAME: requests clamp their features "
        '({"kind": "clamp", "sae": NAME, ...}); one per block',
    )
    steering.add_argument(
        "--capture-values",
        metavar="SELECTOR",
        nargs="+",
        help="values requests may capture (the capture field), e.g. 'layers.*.layer_output'; each holds a buffer "
        "of max_num_batched_tokens x hidden_size in the engine",
    )
    steering.add_argument(
        "--max-capture-bytes",
        type=int,
        default=MAX_CAPTURE_BYTES,
        help="bytes of kept rows one request may ask for (counting every token it may feed through the model); "
        "more is answered 400",
    )
    steering.add_argument(
        "--max-steering-entries",
        type=int,
        help="the steering pool's size: distinct contents (the specs one request applies at one block, shared by "
        "every block and request applying the same) the engine holds at once; a request that does not fit waits "
        "(default: as many as 32 MiB holds, within 64..512; see nnterp-vllm plan)",
    )
    steering.add_argument(
        "--steering-directions-per-block",
        type=int,
        default=DIRECTIONS_PER_BLOCK,
        help="caps, ablations and SAE feature clamps one token may have at one block (slots of each pool entry)",
    )
    steering.add_argument(
        "--steering-values",
        metavar="VALUE",
        nargs="+",
        help="the values the steering operation acts at (default: all of layer_output, attention_output, mlp_output, "
        "layer_input): with layer_output alone it runs once per block instead of about three times per block each "
        "step, and specs needing the others (a patch of a sublayer, an ablation everywhere) are answered 400",
    )
    steering.add_argument(
        "--max-relative-dose",
        type=float,
        metavar="D",
        help='the largest |factor| of a relative add spec ("scale": "relative": the factor a fraction of the '
        "stream's norm at its block and token); a larger one is answered 400 before it reaches the engine. It bounds "
        "relative add specs only: an absolute one's size against the stream is not known before it runs (default: "
        "no bound)",
    )
    steering.add_argument(
        "--max-probe-columns",
        type=int,
        default=PROBE_COLUMNS,
        help="probe columns (each class of a probe a request reads, each gate's read) the engine reads at every block "
        "of every step, and so holds at once; 0 reads none (no probes, no gates: a cheaper step)",
    )
    steering.add_argument(
        "--max-steering-specs",
        type=int,
        help="specs one request may carry (default: 4 per layer of the model)",
    )
    steering.add_argument(
        "--max-steering-vectors",
        type=int,
        default=CAPACITY,
        help="vectors the registry holds at most; a POST of a new name to a full registry is answered 409",
    )
    steering.add_argument(
        "--max-request-body-bytes",
        type=int,
        help="request bodies larger than this are answered 413 before they are parsed (default: 4 MiB plus what "
        "--max-steering-specs inline vectors take as JSON)",
    )
    steering.add_argument(
        "--metrics-without-api-key",
        action="store_true",
        help="with --api-key: leave /metrics open (for a Prometheus scraper); /health and /ping always are",
    )
    steering.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="N > 1: N replicas (one engine each) behind one endpoint, on Ray Serve; vectors are shared",
    )
    steering.add_argument("--ray-address", help="with --replicas: an existing Ray cluster (else a local one starts)")
    add_trace_arguments(root)
    root.set_defaults(shutdown_timeout=DRAIN_SECONDS)
    return root


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed and checked as vLLM's serve checks it; the model named as vLLM's serve names it."""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    from .guard import api_keys
    from .traces import check_arguments as check_trace_arguments

    args = parser().parse_args(list(argv))
    if args.model_tag is not None:
        args.model = args.model_tag
    if args.model == EMBEDDED:
        args.served_model_name = args.served_model_name or [EMBEDDED]
    args.model = named(args.model)
    refused = {
        "--headless": args.headless,
        "--grpc": args.grpc,
        "--api-server-count": (args.api_server_count or 1) > 1,
        "--data-parallel-size": args.data_parallel_size > 1,
    }
    for flag, bad in refused.items():
        if bad:
            raise ValueError(f"{flag} is not served with steering: run one API server, and --replicas N to scale out")
    bounds = {
        "--replicas": args.replicas,
        "--max-steering-specs": args.max_steering_specs,
        "--max-steering-vectors": args.max_steering_vectors,
        "--max-request-body-bytes": args.max_request_body_bytes,
        "--max-capture-bytes": args.max_capture_bytes,
    }
    for flag, value in bounds.items():
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    dose = args.max_relative_dose
    if dose is not None and not (math.isfinite(dose) and dose > 0):
        raise ValueError(
            f"--max-relative-dose must be a finite number > 0 (the largest |factor| of a relative add spec), got {dose}"
        )
    check_trace_arguments(args, api_keys(args))
    args.sae = [sae_source(source) for source in args.sae or []]
    validate_parsed_serve_args(args)
    return args


def sae_source(source: str) -> Any:
    """``--sae``'s ``NAME=DIR``: the SAE in ``DIR``, loaded under ``NAME`` (`SAE.load`); ValueError naming the
    form where it is not one."""
    from ..specs.saes import SAE

    name, separator, directory = source.partition("=")
    if not separator or not name or not directory:
        raise ValueError(f"--sae takes NAME=DIR (a name, then a SAELens SAE directory), got {source!r}")
    return SAE.load(directory, name)
