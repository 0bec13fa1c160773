"""``--traces``: any nnsight trace, written against a standardized model elsewhere, run on the server's model.

A client writes its experiment as usual against a ``StandardizedVLLM(checkpoint)`` that loads no weights and
starts no engine, and sends each trace with nnsight's own client: ``model.trace(prompt, serve=url,
api_key=key)`` (also ``model.generate``, several invokes, ``tracer.iter``). What the trace saved lands in the
caller's variables; an exception the trace raised is raised there with its type and message.

The routes are nnsight-serve's (`TRACE_PATH` and the edit routes under `EDIT_PATH`, with their wire format, so
nnsight's client is the client, unchanged), handled here (`run_trace`: each invoke's saves are also sent apart;
`Edits`: a block left on the engine with ``model.edit(serve=url)`` runs only for its own key's traces). They run
on an engine of their own beside the steered engine that serves the OpenAI routes: a `StandardizedVLLM` in
nnsight's streaming mode (vLLM's ``AsyncLLM``), whose continuous batch joins the traces of concurrent clients.
In front of them:

- the API key is checked before the body is read (`guard.GuardEveryRoute`; nnsight's client sends it as
  ``ndif-api-key``), so nothing of an unauthenticated body is ever deserialized;
- the body (a trace's or an edit's) is read up to ``--max-trace-bytes``, 413 past it, before anything is
  deserialized (`body_bound`, which `intake.RequestIntake` applies);
- a trace runs at most ``--trace-timeout`` seconds: 408 past it, its requests aborted in the engine;
- what a trace saved is sent back up to ``--max-saved-bytes``: 413 past it.

A trace is code the server runs, with the server's rights: ``--traces`` trusts whoever holds an API key
as much as whoever started the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import ipaddress
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from ..engines.remote import TRACE_PATH
from ..engines.saving import WRITTEN
from .errors import error_json

#: The header nnsight's client sends its key in.
NNSIGHT_KEY_HEADER = "ndif-api-key"
#: nnsight-serve's edit routes: ``EDIT_PATH + id`` installs a block (``model.edit(serve=url)``), ``.../clear``
#: clears it.
EDIT_PATH = "/v1/nnsight/register/"
MAX_TRACE_BYTES = 64 * 2**20
TRACE_TIMEOUT_SECONDS = 600.0
MAX_SAVED_BYTES = 1 << 30
#: Traces cancelled past their time, and collects of requests cancelled before theirs, held until they have wound
#: up (`keep_until_done`).
_winding_up: set[asyncio.Future] = set()
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


def sent_code(path: str) -> bool:
    """Whether ``path`` is a route taking nnsight's serialized code: `TRACE_PATH`, or an edit's under `EDIT_PATH`."""
    return path == TRACE_PATH or path.startswith(EDIT_PATH)


def body_bound(args: argparse.Namespace) -> dict[str, tuple[int, str]]:
    """The body bound of `TRACE_PATH` and of the paths under `EDIT_PATH`, and what a larger body is answered
    (`intake.RequestIntake` applies them)."""
    message = (
        f"the trace is larger than this server reads ({args.max_trace_bytes} bytes, --max-trace-bytes): send "
        "less (save fewer values into the trace), or start the server with a larger bound"
    )
    return {path: (args.max_trace_bytes, message) for path in (TRACE_PATH, EDIT_PATH)}


def add_route(app: FastAPI, args: argparse.Namespace) -> None:
    """`TRACE_PATH` on ``app`` (`run_trace`, behind the time and saved-bytes bounds; the body's is `body_bound`), and
    nnsight-serve's edit routes under `EDIT_PATH`, each caller's edits kept apart (`Edits`)."""
    edits = Edits()

    async def bounded_trace(request: Request) -> Response:
        running = asyncio.ensure_future(run_trace(request, edits))
        await asyncio.wait({running}, timeout=args.trace_timeout)
        if not running.done():
            # Cancelled, its requests are aborted and collected as soon as the engine answers; the client is
            # answered now, not when the step a trace body holds up ends.
            running.cancel()
            keep_until_done(running)
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

    async def install_edit(registration_id: str, request: Request, name: str | None = None) -> Response:
        return await edits.install(request, registration_id, name)

    async def clear_edit(registration_id: str, request: Request) -> Response:
        return await edits.clear(request, registration_id)

    app.add_api_route(TRACE_PATH, bounded_trace, methods=["POST"], include_in_schema=False)
    app.add_api_route(EDIT_PATH + "{registration_id}", install_edit, methods=["POST"], include_in_schema=False)
    app.add_api_route(EDIT_PATH + "{registration_id}/clear", clear_edit, methods=["POST"], include_in_schema=False)


def keep_until_done(task: asyncio.Future) -> None:
    """Hold ``task`` until it has wound up (the event loop holds tasks weakly)."""
    _winding_up.add(task)
    task.add_done_callback(_winding_up.discard)


async def run_trace(request: Request, edits: Edits) -> Response:
    """nnsight-serve's trace handler, with each invoke's saves kept apart and only the caller's own edits run.

    The answer is nnsight-serve's (``torch.save`` of ``{"saves": merged, "error": first error}``, which nnsight's
    own client reads) with ``"invokes"`` beside it: each invoke's saves, in invoke order (the same objects, stored
    once), from which `engines.vllm.ServedTrace` fills a list several invokes filled as a local trace does.
    """
    from nnsight.intervention.errors import capture_exception
    from nnsight.modeling.vllm.serve import server as nnsight_serve
    from nnsight.tracing.globals import SOURCES

    model = nnsight_serve._ready()
    body = await request.body()
    compress = request.headers.get("nnsight-compress", "False").lower() == "true"
    try:
        # Built without an await, so concurrent builds never interleave on the model's one interleaver.
        tracer = nnsight_serve._build_tracer(body, compress)
        # nnsight reads a file's source once per process, but each trace brings its own under its client's file
        # name (put in linecache by the build): a second trace from a file of the same name must not find the first's.
        SOURCES.pop(tracer.info.frame.f_code.co_filename, None)
        _, (prompts, params, lora_requests), forward_kwargs = tracer.prepare(tracer.info.code)
        model._attach_mediators(params, **forward_kwargs)
        for param in params:
            param.extra_args["nnsight_edits"] = edits.run_by(caller(request), param.extra_args.get("nnsight_edits"))
    except Exception as exception:
        return saved_answer([], capture_exception(exception))
    finally:
        model.interleaver.cancel()
    outcomes = await asyncio.gather(
        *(
            run_invoke(model.vllm_entrypoint, prompt, param, lora_requests[index] if lora_requests else None)
            for index, (prompt, param) in enumerate(zip(prompts, params))
        ),
        return_exceptions=True,
    )
    invokes, error = [], None
    for outcome in outcomes:
        saves, raised = ({}, capture_exception(outcome)) if isinstance(outcome, BaseException) else outcome
        invokes.append(saves)
        error = error or raised
    return saved_answer(invokes, error)


async def run_invoke(engine: Any, prompt: Any, param: Any, lora_request: Any) -> tuple[dict[str, Any], Any]:
    """One invoke's request through ``engine``: its saves and its error (``None`` where it raised none); a request
    cancelled before it was collected is collected all the same, so its worker does not outlive it."""
    from nnsight.modeling.vllm.engines.engine import acollect

    request_id = str(uuid.uuid4())
    collected = False
    try:
        output = None
        async for output in engine.generate(prompt, param, request_id, lora_request=lora_request):  # noqa: B007
            pass  # the last output is the finished one
        # The finished output goes back with the collect: the worker needs it to serve ``tracer.result``.
        entry = await acollect(engine, request_id, output)
        collected = True
        return (entry["saves"], entry["error"]) if entry is not None else ({}, None)
    finally:
        if not collected:
            cleanup = asyncio.ensure_future(acollect(engine, request_id))
            keep_until_done(cleanup)
            await asyncio.shield(cleanup)


def saved_answer(invokes: list[dict[str, Any]], error: Any) -> Response:
    """A trace's answer: nnsight-serve's merged ``"saves"`` (a later invoke's value wins a name, as nnsight merges
    them) and ``"error"``, and each invoke's own saves under ``"invokes"``."""
    merged = {name: value for saves in invokes for name, value in saves.items() if name != WRITTEN}
    buffer = io.BytesIO()
    torch.save({"saves": merged, "invokes": invokes, "error": error}, buffer)
    return Response(content=buffer.getvalue(), media_type="application/octet-stream")


def caller(request: Request) -> str:
    """Whose edits a request installs, clears and runs: a digest of the key it came with, ``""`` without one. The
    key is the bearer token, which the guard checked (having put a checked ``ndif-api-key`` there), where the
    server has keys; on a server without keys, either header."""
    bearer = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    key = bearer or request.headers.get(NNSIGHT_KEY_HEADER, "").strip()
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""


class Edits:
    """Blocks clients left on the trace engine with ``model.edit(serve=url)`` (nnsight-serve's edit routes), each
    caller's (`caller`: its key) apart from every other's.

    nnsight's engine runs an edit installed without a name for every request, and every edit for a request that
    names none. Here every edit is installed under a name of its caller's (`engine_name`), and each trace request
    names the edits it runs (`run_by`): its caller's own, all of them or those it asked for by name (with the
    caller's unnamed ones, as nnsight runs them). So one client's edit never changes another client's trace, and
    an edit is cleared only by the key that installed it.
    """

    def __init__(self) -> None:
        #: ``{caller: {registration id: name or None}}``.
        self.installed: dict[str, dict[str, str | None]] = {}

    @staticmethod
    def engine_id(who: str, registration_id: str) -> str:
        return f"{who}:{registration_id}"

    @staticmethod
    def engine_name(who: str, registration_id: str, name: str | None) -> str:
        return f"{who}:name:{name}" if name is not None else f"{who}:id:{registration_id}"

    def run_by(self, who: str, asked: list[str] | None) -> list[str]:
        """The engine names of the edits a request of ``who`` runs, having asked for ``asked`` (``edits=``;
        ``None``: all of its own); a name none of its edits has is refused, naming the ones it has."""
        own = self.installed.get(who, {})
        if asked is None:
            return sorted({self.engine_name(who, key, name) for key, name in own.items()})
        names = {name for name in own.values() if name is not None}
        unknown = [name for name in asked if name not in names]
        if unknown:
            raise ValueError(
                f"edits={list(asked)!r} names {unknown!r}, but no edit is installed on this server under that name "
                f"with this API key (installed: {sorted(names)!r}). Install it with model.edit(name=..., serve=url), "
                "or drop it from the list."
            )
        unnamed = [self.engine_name(who, key, None) for key, name in own.items() if name is None]
        return [self.engine_name(who, "", name) for name in dict.fromkeys(asked)] + unnamed

    async def install(self, request: Request, registration_id: str, name: str | None) -> Response:
        """nnsight-serve's install route: the block in the body goes on the engine under its caller's name."""
        from nnsight.modeling.vllm.serve import server as nnsight_serve

        engine = nnsight_serve._ready().vllm_entrypoint
        who = caller(request)
        payload = await request.body()
        try:
            await engine.collective_rpc(
                "nnsight_register",
                args=(self.engine_id(who, registration_id), payload, self.engine_name(who, registration_id, name)),
            )
        except Exception as exception:
            return refused(f"the edit could not be installed: {exception}", HTTPStatus.BAD_REQUEST)
        self.installed.setdefault(who, {})[registration_id] = name
        return JSONResponse({"status": "ok", "id": registration_id, "name": name})

    async def clear(self, request: Request, registration_id: str) -> Response:
        """nnsight-serve's clear route: an edit of the caller's own comes off the engine; any other id is a no-op."""
        from nnsight.modeling.vllm.serve import server as nnsight_serve

        engine = nnsight_serve._ready().vllm_entrypoint
        who = caller(request)
        own = self.installed.get(who, {})
        if registration_id in own:
            del own[registration_id]
            await engine.collective_rpc("nnsight_clear_registered", args=(self.engine_id(who, registration_id),))
        return JSONResponse({"status": "ok", "id": registration_id})


def refused(message: str, status: HTTPStatus) -> Response:
    """An answer nnsight's client raises as ``ConnectionError`` with ``message`` (it reads ``detail``)."""
    return error_json(message, None, status, detail=True)
