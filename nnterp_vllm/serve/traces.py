"""``--traces``: any nnsight trace, written against a standardized model elsewhere, run on the server's model.

A client writes its experiment as usual against a ``StandardizedVLLM(checkpoint)`` that loads no weights and
starts no engine, and sends each trace with nnsight's own client: ``model.trace(prompt, serve=url,
api_key=key)`` (also ``model.generate``, several invokes, ``tracer.iter``). What the trace saved lands in the
caller's variables; an exception the trace raised is raised there with its type and message.

The routes are nnsight-serve's (`TRACE_PATH` and the edit routes under `EDIT_PATH`, with their wire format, so
nnsight's client is the client, unchanged), handled here (`run_trace`: each invoke's saves are also sent apart;
`Edits`: a block left on the engine with ``model.edit(serve=url)`` runs only for its own key's traces). They run
on the engine of the OpenAI routes, in its continuous batch: a trace's requests go to the steered engine as
nnsight's own requests do (each invoke's code serialized onto its request), and a step that runs trace code runs
eagerly with nnsight's interleaving while the others stay compiled (`engines.steered.runners`). A weightless
`StandardizedVLLM` of the same checkpoint rebuilds each trace (`TraceBuilder`). In front of them:

- the API key is checked before the body is read (`guard.GuardEveryRoute`; nnsight's client sends it as
  ``ndif-api-key``), so nothing of an unauthenticated body is ever deserialized;
- the body (a trace's or an edit's) is read up to ``--max-trace-bytes``, 413 past it, before anything is
  deserialized (`body_bound`, which `intake.RequestIntake` applies);
- a trace runs at most ``--trace-timeout`` seconds: 408 past it, its requests aborted in the engine;
- what a trace saves is counted in the engine as its steps save it, and the trace is refused (413) as soon as it
  would pass ``--max-saved-bytes`` (`engines.saving.SavedBytes`); the answer is streamed out as it is serialized.

A trace is code the server runs, with the server's rights: ``--traces`` trusts whoever holds an API key
as much as whoever started the server.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import ipaddress
import threading
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from ..engines.saving import SAVED_BYTES_KEY, WRITTEN
from ..errors import SavedTooMuch
from ..remote import EDITS_KEY, TRACE_PATH
from .errors import error_json

#: The header nnsight's client sends its key in.
NNSIGHT_KEY_HEADER = "ndif-api-key"
#: nnsight-serve's edit routes: ``EDIT_PATH + id`` installs a block (``model.edit(serve=url)``), ``.../clear``
#: clears it.
EDIT_PATH = "/v1/nnsight/register/"
MAX_TRACE_BYTES = 64 * 2**20
TRACE_TIMEOUT_SECONDS = 600.0
MAX_SAVED_BYTES = 1 << 30
#: Bytes of a trace's serialized answer handed to the response at a time, and how many such parts wait at most.
ANSWER_PART_BYTES = 2**20
ANSWER_PARTS_WAITING = 4
#: Traces cancelled past their time, and collects of requests cancelled before theirs, held until they have wound
#: up (`keep_until_done`).
_winding_up: set[asyncio.Future] = set()
#: Engine arguments of ``vllm serve`` that shape the model's module tree, which the weightless model rebuilding
#: traces is built with too, where given.
TREE_ARGUMENTS = ("dtype", "max_model_len", "revision", "tokenizer", "trust_remote_code")


def add_arguments(parser: Any) -> None:
    """``--traces`` and its bounds, on ``nnterp-vllm serve``'s parser."""
    group = parser.add_argument_group("Traces")
    group.add_argument(
        "--traces",
        action="store_true",
        help=f"run nnsight traces sent with model.trace(..., serve=URL, api_key=KEY) at {TRACE_PATH}, on the "
        "engine of the OpenAI routes. A trace is code the server runs with its rights: whoever holds an API key is "
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
        help="bytes of values one trace may save, counted in the engine as they are saved; a trace that would "
        "save more is stopped there and answered 413",
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


class TraceBuilder:
    """What rebuilds a sent trace as requests of the server's engine: a weightless `StandardizedVLLM` of the
    server's checkpoint (its module tree, no engine), against which nnsight's serialized trace is read back and
    each invoke's code serialized onto its request, as nnsight's own client does."""

    def __init__(self, args: argparse.Namespace) -> None:
        from ..engines.vllm import StandardizedVLLM

        given = {name: getattr(args, name, None) for name in TREE_ARGUMENTS}
        self.model = StandardizedVLLM(
            args.model, **{name: value for name, value in given.items() if value is not None and value != "auto"}
        )
        # Edits reach the engine over HTTP, so nnsight's client-side check of their names has nothing to consult.
        self.model._serving = True
        self.persistent_objects = self.model._remoteable_persistent_objects()

    def requests(self, body: bytes, compress: bool) -> tuple[list[Any], list[Any], list[Any]]:
        """The prompts, sampling params (each invoke's code in its ``extra_args``) and LoRA requests of a sent trace.

        Built without an await, so concurrent builds never interleave on the model's one interleaver; nnsight
        reads a file's source once per process, but each trace brings its own under its client's file name (put in
        linecache by the build): a second trace from a file of the same name must not find the first's."""
        import ast
        import linecache

        from nnsight.schema.request import RequestModel
        from nnsight.tracing.globals import SOURCES

        model = self.model
        try:
            tracer = RequestModel.deserialize(body, self.persistent_objects, compress=compress)
            filename = tracer.info.frame.f_code.co_filename
            tracer.node = ast.parse("".join(linecache.cache[filename][2]))
            SOURCES.pop(filename, None)
            _, (prompts, params, lora_requests), forward_kwargs = tracer.prepare(tracer.info.code)
            model._attach_mediators(params, **forward_kwargs)
        finally:
            model.interleaver.cancel()
        return prompts, params, lora_requests or [None] * len(prompts)


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


def add_route(app: FastAPI, args: argparse.Namespace, engine: Any) -> None:
    """`TRACE_PATH` on ``app`` (`run_trace` on ``engine``, behind the time bound; the body's is `body_bound`, the
    saved values' is counted in the engine), and nnsight-serve's edit routes under `EDIT_PATH`, each caller's edits
    kept apart (`Edits`)."""
    builder = TraceBuilder(args)
    edits = Edits(engine)

    async def bounded_trace(request: Request) -> Response:
        running = asyncio.ensure_future(run_trace(request, builder, engine, edits, args.max_saved_bytes))
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
        invokes, error = running.result()
        if error is not None and error.get("type_name") == SavedTooMuch.__name__:
            return refused(
                f"{error.get('message')} (--max-saved-bytes): save less (a slice, a reduction), or start the "
                "server with a larger bound",
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            )
        return saved_answer(invokes, error)

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


async def run_trace(
    request: Request, builder: TraceBuilder, engine: Any, edits: Edits, max_saved_bytes: int
) -> tuple[list[dict[str, Any]], Any]:
    """nnsight-serve's trace handler on ``engine``, with only the caller's own edits run and the trace's saved
    values bounded in the engine (`engines.saving.SavedBytes`): each invoke's saves, in invoke order, and the first
    error (nnsight's deferred form) or ``None``."""
    from nnsight.intervention.errors import capture_exception

    body = await request.body()
    compress = request.headers.get("nnsight-compress", "False").lower() == "true"
    try:
        prompts, params, lora_requests = builder.requests(body, compress)
        bound = {"trace": uuid.uuid4().hex, "bytes": max_saved_bytes}
        for param in params:
            param.extra_args[EDITS_KEY] = edits.run_by(caller(request), param.extra_args.get(EDITS_KEY))
            param.extra_args[SAVED_BYTES_KEY] = bound
    except Exception as exception:
        return [], capture_exception(exception)
    outcomes = await asyncio.gather(
        *(run_invoke(engine, *request) for request in zip(prompts, params, lora_requests)), return_exceptions=True
    )
    invokes, error = [], None
    for outcome in outcomes:
        saves, raised = ({}, capture_exception(outcome)) if isinstance(outcome, BaseException) else outcome
        invokes.append(saves)
        error = error or raised
    return invokes, error


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
    them) and ``"error"``, and each invoke's own saves under ``"invokes"`` (the same objects, stored once), in
    ``torch.save``'s format, streamed out as it is serialized (`streamed`)."""
    merged = {name: value for saves in invokes for name, value in saves.items() if name != WRITTEN}
    answer = {"saves": merged, "invokes": invokes, "error": error}
    return StreamingResponse(streamed(answer), media_type="application/octet-stream")


async def streamed(answer: Any) -> AsyncIterator[bytes]:
    """``torch.save(answer)``'s bytes, serialized on a thread and handed on a part at a time: at most
    `ANSWER_PARTS_WAITING` parts of `ANSWER_PART_BYTES` wait for the client, never the whole answer."""
    loop = asyncio.get_running_loop()
    parts: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(ANSWER_PARTS_WAITING)
    gone = threading.Event()

    def put(part: bytes | BaseException | None) -> None:
        if not gone.is_set():
            asyncio.run_coroutine_threadsafe(parts.put(part), loop).result()

    class Parts:
        def write(self, data: Any) -> int:
            view = memoryview(data).cast("B")
            for start in range(0, len(view), ANSWER_PART_BYTES):
                if gone.is_set():
                    raise ConnectionAbortedError("the client went away")
                put(bytes(view[start : start + ANSWER_PART_BYTES]))
            return len(view)

        def flush(self) -> None:
            pass

    def serialize() -> None:
        try:
            torch.save(answer, Parts())
        except BaseException as error:  # noqa: BLE001 - handed to the response, which raises it
            put(error)
        else:
            put(None)

    writer = loop.run_in_executor(None, serialize)
    try:
        while (part := await parts.get()) is not None:
            if isinstance(part, BaseException):
                raise part
            yield part
    finally:
        gone.set()
        while not parts.empty():
            parts.get_nowait()
        await writer


def caller(request: Request) -> str:
    """Whose edits a request installs, clears and runs: a digest of the key it came with, ``""`` without one. The
    key is the bearer token, which the guard checked (having put a checked ``ndif-api-key`` there), where the
    server has keys; on a server without keys, either header."""
    bearer = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    key = bearer or request.headers.get(NNSIGHT_KEY_HEADER, "").strip()
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""


def runs_no_edits(params: Any) -> Any:
    """``params`` of a request that is not a trace's (an OpenAI route's), naming no edit to run: nnsight's engine runs
    every edit for a request that names none, and an edit is its key's, for its key's traces only."""
    extra = params.extra_args or {}
    if EDITS_KEY in extra:
        return params
    params = params.clone()
    params.extra_args = {**extra, EDITS_KEY: []}
    return params


class Edits:
    """Blocks clients left on the engine with ``model.edit(serve=url)`` (nnsight-serve's edit routes), each
    caller's (`caller`: its key) apart from every other's.

    nnsight's engine runs an edit installed without a name for every request, and every edit for a request that
    names none. Here every edit is installed under a name of its caller's (`engine_name`), each trace request
    names the edits it runs (`run_by`): its caller's own, all of them or those it asked for by name (with the
    caller's unnamed ones, as nnsight runs them), and every other request names none (`runs_no_edits`). So one
    client's edit never changes another client's trace nor any OpenAI request, and an edit is cleared only by the
    key that installed it.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
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
        who = caller(request)
        payload = await request.body()
        try:
            await self.engine.collective_rpc(
                "nnsight_register",
                args=(self.engine_id(who, registration_id), payload, self.engine_name(who, registration_id, name)),
            )
        except Exception as exception:
            return refused(f"the edit could not be installed: {exception}", HTTPStatus.BAD_REQUEST)
        self.installed.setdefault(who, {})[registration_id] = name
        return JSONResponse({"status": "ok", "id": registration_id, "name": name})

    async def clear(self, request: Request, registration_id: str) -> Response:
        """nnsight-serve's clear route: an edit of the caller's own comes off the engine; any other id is a no-op."""
        who = caller(request)
        own = self.installed.get(who, {})
        if registration_id in own:
            del own[registration_id]
            await self.engine.collective_rpc("nnsight_clear_registered", args=(self.engine_id(who, registration_id),))
        return JSONResponse({"status": "ok", "id": registration_id})


def refused(message: str, status: HTTPStatus) -> Response:
    """An answer nnsight's client raises as ``ConnectionError`` with ``message`` (it reads ``detail``)."""
    return error_json(message, None, status, detail=True)
