"""``--api-key`` on every route: vLLM guards only paths under ``/v1`` (and a few prefixes); this guards all.

Open without a key: ``/health`` and ``/ping`` (a load balancer's liveness probes), and ``/metrics`` with
``--metrics-without-api-key`` (a Prometheus scraper). On the routes of traces and edits the key may also come as
nnsight's client sends it (``ndif-api-key: <key>``); on every other route, from a browser, as the playground's
cookie (on a same-origin request only; `playground.sign_in` sets it, and answers the page's paths with its form
while a browser holds no key). Everything else, ``/invocations``, ``/tokenize`` and the vector registry included,
answers 401 to a request without a valid key before anything reads its body or looks anything up, so the answer
tells nothing about what exists.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable
from http import HTTPStatus

from starlette.datastructures import Headers
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Receive, Scope, Send
from vllm import envs
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

from .errors import error_json
from .playground import KEY_COOKIE, PAGE_PATHS, same_origin, sign_in
from .traces import NNSIGHT_KEY_HEADER, sent_code

OPEN_PATHS = ("/health", "/ping")
#: vLLM serves Prometheus metrics on every path that starts with this (a mounted app).
METRICS_PREFIX = "/metrics"


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys a request may carry, as vLLM reads them: ``--api-key`` (any number), else ``VLLM_API_KEY``."""
    return [key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]


class GuardEveryRoute(AuthenticationMiddleware):
    """vLLM's API-key middleware (its token check), applied to every path but the open ones."""

    def __init__(self, app: ASGIApp, tokens: list[str], metrics_open: bool) -> None:
        super().__init__(app, tokens)
        self.metrics_open = metrics_open

    def is_open(self, path: str) -> bool:
        """Whether ``path`` answers without a key."""
        return path in OPEN_PATHS or (self.metrics_open and path.startswith(METRICS_PREFIX))

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        headers = Headers(scope=scope)
        tracing = sent_code(path)
        if self.is_open(path) or self.verify_token(headers):
            return self.app(scope, receive, send)
        cookie = cookie_parser(headers.get("cookie", "")).get(KEY_COOKIE)
        if cookie and not tracing and same_origin(scope, headers) and self.valid_key(cookie):
            return self.app(with_bearer(scope, cookie), receive, send)
        if tracing and self.valid_key(headers.get(NNSIGHT_KEY_HEADER)):
            return self.app(with_bearer(scope, headers[NNSIGHT_KEY_HEADER]), receive, send)
        if path in PAGE_PATHS:
            return sign_in(scope, receive, send, headers, self.valid_key)
        sent = f"'{NNSIGHT_KEY_HEADER}: <key>' (nnsight's api_key=) or " if tracing else ""
        response = error_json(
            f"a valid API key is required: send the header {sent}'Authorization: Bearer <key>' with a key the "
            "server was started with (--api-key)",
            None,
            HTTPStatus.UNAUTHORIZED,
            detail=tracing,
        )
        return response(scope, receive, send)

    def valid_key(self, key: str | None) -> bool:
        """Whether ``key`` is a key of the server's (vLLM's check of a bearer token)."""
        return bool(key) and self.verify_token(Headers({"authorization": f"Bearer {key}"}))


def with_bearer(scope: Scope, key: str) -> Scope:
    """``scope`` with ``key`` as its ``Authorization`` header: vLLM's own key check, inside, reads only that."""
    kept = [(name, value) for name, value in scope["headers"] if name != b"authorization"]
    return {**scope, "headers": [*kept, (b"authorization", b"Bearer " + key.encode("utf-8"))]}
