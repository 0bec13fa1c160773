"""What happens to a request before vLLM parses it: its body is bounded, and the fields we add are taken out.

vLLM parses a request's body whole, on the event loop that also answers every other client. Here, in
front of vLLM's app (`RequestIntake`, a pure ASGI middleware):

- a body larger than ``--max-request-body-bytes`` is answered 413 as soon as its size is known (its
  declared length, or the bytes received so far), before it is parsed;
- a body naming one of our fields (``steering``) is parsed and the field read and checked, number by
  number, on a thread: bodies above `FAST_PARSE_BYTES` with the pure-Python JSON scanner, which lets the
  event loop run between values. The field is taken out of the body vLLM then parses, and what was read
  is kept for the request (`taken`), where vLLM's handler, once it has rendered the prompts, checks it
  against them and records the result (`check`) that the engine client applies (`checked`);
- a field sent to a route that does not serve it, and ``vllm_xargs`` keys reserved for the server, are
  answered 400: nothing is accepted and ignored, nothing unchecked reaches the engine.

A request naming a steered model (``"model": NAME``, `steered_models`) on a route that serves ``steering`` is
read whatever it holds: its name is swapped for the base model's before vLLM reads the body, the recipe's specs
go before the request's own ``steering``, and its response names the steered model again.

A field whose result goes back in the response (``capture``, ``probes``) has a ``respond`` step, handed what the
request recorded (`record`): the request's JSON response is held until its end, handed to it, and sent on; a
streamed response (server-sent events) goes out as it comes, each chunk that finishes a choice (the one carrying
its ``finish_reason``) handed to it first.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import json
import json.scanner
import time
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import InvalidField, error_json, refusal

#: Bodies up to this size are parsed by the C JSON parser in one go (about 30 ms per MiB here, the
#: interpreter held throughout); larger ones by the pure-Python scanner, which yields between values.
FAST_PARSE_BYTES = 2**20
#: Numbers a large body's parse reads between two hand-overs of the interpreter (`decode_json`).
YIELD_EVERY = 64
#: Request bodies this server reads at most, unless told otherwise (more where the largest steering needs it).
MAX_BODY_BYTES = 4 * 2**20
#: ``vllm_xargs`` keys a client may not send: they would reach the engine unchecked.
RESERVED_PREFIX = "nnterp_vllm"
#: HTTP methods whose body is read here.
BODY_METHODS = ("POST", "PUT", "PATCH")


def decode_json(body: bytes) -> Any:
    """``body`` parsed as JSON (``ValueError`` if it is not), without holding the interpreter for long.

    Meant for a thread beside the event loop: above `FAST_PARSE_BYTES` the parse hands the interpreter over
    every `YIELD_EVERY` numbers (a thread left to the interpreter's own switching keeps it for 5 ms at a
    time, so the loop's thread would get it back only after each of its many waits).
    """
    if len(body) <= FAST_PARSE_BYTES:
        return json.loads(body)
    parsed = 0

    def number(text: str, kind: type) -> Any:
        nonlocal parsed
        parsed += 1
        if parsed % YIELD_EVERY == 0:
            hand_over()
        return kind(text)

    decoder = json.JSONDecoder(
        parse_float=functools.partial(number, kind=float), parse_int=functools.partial(number, kind=int)
    )
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    return decoder.decode(body.decode("utf-8"))


def hand_over() -> None:
    """Let the event loop's thread run, from work on a thread beside it."""
    time.sleep(0)


@dataclasses.dataclass(frozen=True)
class RequestField:
    """A field of a request body that this server adds to vLLM's API.

    ``read(value)`` checks the field's value as sent (it runs on a thread; raises `InvalidField`) and returns
    what the handler needs from it; ``routes`` are the paths that serve it (elsewhere it is refused);
    ``respond(body, recorded)``, where given, puts what the request recorded into its JSON response ``body`` (in a
    streamed response, into a chunk's finished choices: ``{"choices": [...]}``).
    """

    name: str
    routes: tuple[str, ...]
    read: Callable[[Any], Any]
    respond: Callable[[dict[str, Any], dict[str, Any]], None] | None = None


@dataclasses.dataclass
class RequestFields:
    """One request's fields: as the intake read them, as its handler checked them against the prompts, and what
    its generation recorded for the response (by field, then by the engine's request id)."""

    taken: dict[str, Any]
    checked: dict[str, Any] = dataclasses.field(default_factory=dict)
    recorded: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: The steered model the request asked for (its response names it), if it asked for one.
    model: str | None = None


_CURRENT: contextvars.ContextVar[RequestFields | None] = contextvars.ContextVar("nnterp_vllm_fields", default=None)


def taken(name: str) -> Any:
    """What the intake read of the current request's field ``name`` (``None`` if it was not sent)."""
    fields = _CURRENT.get()
    return None if fields is None else fields.taken.get(name)


def check(name: str, value: Any) -> None:
    """Record the current request's field ``name`` as its handler checked it (what `checked` returns)."""
    fields = _CURRENT.get()
    if fields is not None:
        fields.checked[name] = value


def checked(name: str) -> Any:
    """The current request's field ``name`` as its handler checked it (``None`` if none was)."""
    fields = _CURRENT.get()
    return None if fields is None else fields.checked.get(name)


def record(name: str, request_id: str, value: Any) -> None:
    """Keep ``value`` for the current request's response, under field ``name`` and the engine's ``request_id``."""
    fields = _CURRENT.get()
    if fields is not None:
        fields.recorded.setdefault(name, {})[request_id] = value


def limit_message(limit: int) -> str:
    """What a 413 says."""
    return (
        f"the request body is larger than this server reads ({limit} bytes, --max-request-body-bytes): send less "
        "(register a steering vector once at /v1/steering/vectors and name it), or start the server with a larger bound"
    )


class RequestIntake:
    """Pure ASGI middleware in front of vLLM's app: bounds request bodies and takes out our `RequestField` s.

    A path of ``own_bounds`` (``{path: (bytes, message)}``, routes that are not vLLM's JSON API; a path ending in
    ``/`` stands for every path under it) has a bound of its own, answered 413 with its message (also as FastAPI's
    ``detail``); its body is handed on as it came. With ``steered_models`` (`steered_models.SteeredModelNames`),
    a request on a route of the field ``steered_field`` asking for a steered model gets its recipe in that field."""

    def __init__(
        self,
        app: ASGIApp,
        fields: Sequence[RequestField],
        max_body_bytes: int,
        own_bounds: Mapping[str, tuple[int, str]] | None = None,
        steered_models: Any = None,
        steered_field: str = "steering",
    ) -> None:
        self.app = app
        self.fields = {field.name: field for field in fields}
        self.max_body_bytes = max_body_bytes
        self.own_bounds = dict(own_bounds or {})
        self.steered_models = steered_models
        self.steered_field = steered_field
        # A body holding none of these bytes holds none of the fields (JSON may spell a key with \u escapes).
        self.markers = [f'"{name}"'.encode() for name in self.fields] + [b"\\u", RESERVED_PREFIX.encode()]

    def own_bound(self, path: str) -> tuple[int, str] | None:
        """The bound of ``path`` where it has one of its own (`own_bounds`)."""
        for bounded, bound in self.own_bounds.items():
            if path == bounded or (bounded.endswith("/") and path.startswith(bounded)):
                return bound
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        own = self.own_bound(path)
        limit, explained = own or (self.max_body_bytes, limit_message(self.max_body_bytes))
        too_large = error_json(explained, None, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, detail=own is not None)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if own is not None:
            await self.app(scope, _replay(body, receive), send)
            return
        steered = (
            self.steered_models is not None
            and path in self.fields[self.steered_field].routes
            and await self.steered_models.may_be_asked(body)
        )
        asked = None
        try:
            parsed, fields = (None, {})
            if steered or any(marker in body for marker in self.markers):
                parsed, fields = await asyncio.to_thread(self._take, body, path)
            if steered and parsed is not None:
                recipe = await self.steered_models.recipe(parsed.get("model"))
                if recipe is not None:
                    asked, parsed["model"] = parsed["model"], self.steered_models.base_names[0]
                    fields[self.steered_field] = [*recipe, *fields.get(self.steered_field, [])]
        except InvalidField as error:
            await refusal(error)(scope, receive, send)
            return
        if fields:
            body = await asyncio.to_thread(lambda: json.dumps(parsed).encode())
            headers = [(key, value) for key, value in scope["headers"] if key != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        request = RequestFields(fields, model=asked) if fields else None
        _CURRENT.set(request)
        responding = [self.fields[name] for name in fields if self.fields[name].respond is not None]
        if responding or asked is not None:
            send = _responding(send, request, responding)
        await self.app(scope, _replay(body, receive), send)

    def _take(self, body: bytes, path: str) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """The body as parsed, without our fields (``None``: not a JSON object), and each field as read; raises
        `InvalidField`."""
        try:
            parsed = decode_json(body)
        except (ValueError, RecursionError):
            return None, {}  # vLLM answers a body that is not JSON as it does
        if not isinstance(parsed, dict):
            return None, {}
        xargs = parsed.get("vllm_xargs")
        reserved = [key for key in xargs if str(key).startswith(RESERVED_PREFIX)] if isinstance(xargs, dict) else []
        if reserved:
            raise InvalidField(
                f"vllm_xargs: {reserved[0]!r} is reserved for the server; send steering instead", "vllm_xargs"
            )
        read = {}
        for name in [name for name in self.fields if name in parsed]:
            field = self.fields[name]
            if path not in field.routes:
                raise InvalidField(f"{name} is not served on {path}; it is served on {', '.join(field.routes)}", name)
            read[name] = field.read(parsed.pop(name))
        return parsed, read


def _responding(send: Send, request: RequestFields, fields: Sequence[RequestField]) -> Send:
    """A ``send`` that lets each field's ``respond`` add to a successful response, and names the steered model the
    request asked for in it: a JSON one is held until its end and sent whole; a streamed one (server-sent events) is
    sent as it comes, each chunk named and each finishing a choice with the fields' additions (`_finishing`)."""
    held: list[Message] = []
    streamed = False
    pending = b""  # a streamed event not yet ended by its blank line

    async def sending(message: Message) -> None:
        nonlocal streamed, pending
        if message["type"] == "http.response.start":
            if message["status"] == HTTPStatus.OK:
                content_type = Headers(raw=message["headers"]).get("content-type", "")
                if content_type.startswith("application/json"):
                    held.append(message)
                    return
                streamed = content_type.startswith("text/event-stream")
        if streamed and message["type"] == "http.response.body":
            *events, pending = (pending + message.get("body", b"")).split(b"\n\n")
            body = b"".join(_finishing(event, request, fields) + b"\n\n" for event in events)
            if not message.get("more_body", False):
                body, pending = body + pending, b""
            elif not body:
                return
            await send({**message, "body": body})
            return
        if not held:
            await send(message)
            return
        held.append(message)
        if message.get("more_body", False):
            return
        start, *parts = held
        body = json.loads(b"".join(part.get("body", b"") for part in parts))
        for field in fields:
            field.respond(body, request.recorded.get(field.name, {}))
        _named(body, request)
        encoded = json.dumps(body).encode()
        headers = [(key, value) for key, value in start["headers"] if key != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(encoded)).encode())]})
        await send({"type": "http.response.body", "body": encoded, "more_body": False})

    return sending


def _finishing(event: bytes, request: RequestFields, fields: Sequence[RequestField]) -> bytes:
    """A streamed event (``data: <chunk as JSON>``) as it goes out: naming the steered model the request asked for,
    and where its chunk finishes choices (their ``finish_reason`` set), with each field's ``respond`` given them and
    what the request recorded."""
    head, marker, data = event.partition(b"data: {")
    if not marker or not (head == b"" or head.endswith(b"\n")):
        return event
    chunk = json.loads(b"{" + data)
    finished = [choice for choice in chunk.get("choices") or () if choice.get("finish_reason") is not None]
    renamed = _named(chunk, request)
    if not finished and not renamed:
        return event
    for field in fields if finished else ():
        field.respond({"choices": finished}, request.recorded.get(field.name, {}))
    return head + b"data: " + json.dumps(chunk).encode()


def _named(body: dict[str, Any], request: RequestFields) -> bool:
    """Name the steered model the request asked for where ``body`` (a response, or a streamed event's data) names the
    model: at its top, or in an object it carries (``/v1/messages``' ``message``, ``/v1/responses``' ``response``);
    whether it named one."""
    if request.model is None:
        return False
    named = False
    for part in (body, *(value for value in body.values() if isinstance(value, dict))):
        if "model" in part:
            part["model"], named = request.model, True
    return named


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands over ``body`` whole, then waits on the client as ``receive`` does (disconnects)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
