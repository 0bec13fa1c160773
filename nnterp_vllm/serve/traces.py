"""``--traces``: any nnsight trace, written against a standardized model elsewhere, run on the server's model.

A client writes its experiment as usual against a ``StandardizedVLLM(checkpoint)`` that loads no weights and
starts no engine, and sends each trace with nnsight's own client: ``model.trace(prompt, serve=url,
api_key=key)`` (also ``model.generate``, several invokes, ``tracer.iter``). What the trace saved lands in the
caller's variables; an exception the trace raised is raised there with its type and message.

The route is nnsight-serve's (`TRACE_PATH`, its handler and its wire format, so nnsight's client is the
client, unchanged). It runs on an engine of its own beside the steered engine that serves the OpenAI routes:
a `StandardizedVLLM` in nnsight's streaming mode (vLLM's ``AsyncLLM``), whose continuous batch joins the
traces of concurrent clients. In front of it:

- the API key is checked before the body is read (`guard.GuardEveryRoute`; nnsight's client sends it as
  ``ndif-api-key``), so nothing of an unauthenticated body is ever deserialized;
- the body is read up to ``--max-trace-bytes``, 413 past it, before anything is deserialized (`body_bound`, which
  `intake.RequestIntake` applies);
- a trace runs at most ``--trace-timeout`` seconds: 408 past it, its requests aborted in the engine;
- what a trace saved is sent back up to ``--max-saved-bytes``: 413 past it.

A trace is code the server runs, with the server's rights: ``--traces`` trusts whoever holds an API key
as much as whoever started the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request, Response

from ..engines.remote import TRACE_PATH
from .errors import error_json

#: The header nnsight's client sends its key in.
NNSIGHT_KEY_HEADER = "ndif-api-key"
MAX_TRACE_BYTES = 64 * 2**20
TRACE_TIMEOUT_SECONDS = 600.0
MAX_SAVED_BYTES = 1 << 30
#: Traces cancelled past their time, held until they have wound up (the event loop holds tasks weakly).
_cancelled: set[asyncio.Future] = set()
#: Engine arguments of ``vllm serve`` that the trace engine is built with too, where given.
SHARED_ENGINE_ARGUMENTS = (
    "dtype",
    "max_model_len",
    "tensor_parallel_size",
    "revision",
    "tokenizer",
    "trust_remote_code",
    "kv_cache_memory_bytes",
    "max_num_seqs",
    "max_num_batched_tokens",
    "seed",
)


def add_arguments(parser: Any) -> None:
    """``--traces`` and its bounds, on ``nnterp-vllm serve``'s parser."""
    group = parser.add_argument_group("Traces")
    group.add_argument(
        "--traces",
        action="store_true",
        help=f"run nnsight traces sent with model.trace(..., serve=URL, api_key=KEY) at {TRACE_PATH}, on an "
        "engine of their own. A trace is code the server runs with its rights: whoever holds an API key is "
        "trusted as the server's user. Without --api-key only on a loopback --host",
    )
    group.add_argument(
        "--max-trace-bytes",
        type=int,
        default=MAX_TRACE_BYTES,
        help="serialized traces larger than this are answered 413 before any of them is deserialized",
    )
    group.add_argument(
        "--trace-timeout",
        type=float,
        default=TRACE_TIMEOUT_SECONDS,
        help="seconds a trace may run; past it the trace is answered 408 and its requests are aborted",
    )
    group.add_argument(
        "--max-saved-bytes",
        type=int,
        default=MAX_SAVED_BYTES,
        help="bytes of saved values one trace may send back; more is answered 413",
    )


def check_arguments(args: argparse.Namespace, keys: list[str]) -> None:
    """Refuse what ``--traces`` cannot serve safely, naming why, before anything starts."""
    bounds = {"--max-trace-bytes": args.max_trace_bytes, "--max-saved-bytes": args.max_saved_bytes}
    for flag, value in {**bounds, "--trace-timeout": args.trace_timeout}.items():
        if value <= 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if not args.traces:
        return
    if args.replicas > 1:
        raise ValueError("--traces is served by one server: leave out --replicas")
    if not keys and not loopback(args.host):
        where = "every interface" if not args.host else f"--host {args.host}"
        raise ValueError(
            f"--traces without --api-key would run code sent by anyone who reaches {where}: give --api-key, or "
            "serve on a loopback address (--host 127.0.0.1)"
        )


def loopback(host: str | None) -> bool:
    """Whether ``host`` is a loopback address (``None``, vLLM's default, binds every interface)."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The trace engine's arguments: the ones of `SHARED_ENGINE_ARGUMENTS` given on the command line."""
    given = {name: getattr(args, name, None) for name in SHARED_ENGINE_ARGUMENTS}
    return {name: value for name, value in given.items() if value is not None and value != "auto"}


@contextlib.asynccontextmanager
async def trace_engine(args: argparse.Namespace) -> AsyncIterator[Any]:
    """The model traces run on (dispatched, streaming), registered with nnsight-serve's handler; shut down on exit."""
    from nnsight.modeling.vllm.serve import server as nnsight_serve

    from ..engines.vllm import StandardizedVLLM

    model = StandardizedVLLM(args.model, mode="async", dispatch=True, **engine_kwargs(args))
    try:
        nnsight_serve.set_model(model)
        yield model
    finally:
        model.shutdown()


def body_bound(args: argparse.Namespace) -> dict[str, tuple[int, str]]:
    """`TRACE_PATH`'s body bound and what a larger body is answered (`intake.RequestIntake` applies it)."""
    return {
        TRACE_PATH: (
            args.max_trace_bytes,
            f"the trace is larger than this server reads ({args.max_trace_bytes} bytes, --max-trace-bytes): send "
            "less (save fewer values into the trace), or start the server with a larger bound",
        )
    }


def add_route(app: FastAPI, args: argparse.Namespace) -> None:
    """`TRACE_PATH` on ``app``: nnsight-serve's handler behind the time and saved-bytes bounds (the body's is
    `body_bound`)."""
    from nnsight.modeling.vllm.serve import server as nnsight_serve

    async def run_trace(request: Request) -> Response:
        running = asyncio.ensure_future(nnsight_serve.generate(request))
        await asyncio.wait({running}, timeout=args.trace_timeout)
        if not running.done():
            # Cancelled, its requests are aborted and collected as soon as the engine answers; the client is
            # answered now, not when the step a trace body holds up ends.
            running.cancel()
            _cancelled.add(running)
            running.add_done_callback(_cancelled.discard)
            return refused(
                f"the trace ran past this server's bound ({args.trace_timeout:g} s, --trace-timeout) and was "
                "aborted: run less in one trace (fewer tokens or invokes), or start the server with a larger bound",
                HTTPStatus.REQUEST_TIMEOUT,
            )
        answer = running.result()
        if len(answer.body) > args.max_saved_bytes:
            return refused(
                f"the trace saved {len(answer.body)} bytes, more than this server sends back ({args.max_saved_bytes} "
                "bytes, --max-saved-bytes): save less (a slice, a reduction), or start the server with a larger bound",
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            )
        return answer

    app.add_api_route(TRACE_PATH, run_trace, methods=["POST"], include_in_schema=False)


def refused(message: str, status: HTTPStatus) -> Response:
    """An answer nnsight's client raises as ``ConnectionError`` with ``message`` (it reads ``detail``)."""
    return error_json(message, None, status, detail=True)
