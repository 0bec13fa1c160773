"""vLLM's OpenAI-compatible server with per-request steering: the engine, the handlers and the extra routes.

The HTTP layer, protocol, argument parser, chat templates, streaming, errors and lifecycle are vLLM's
own (``vllm.entrypoints``); this module adds three things, in the shape of a vLLM endpoint plugin
(`SteeringEndpoints`, ``vllm.plugins.endpoint_plugins``' contract: routes at app build, state at
``init_app_state``):

- the engine is `AsyncSteeredVLLM` (`SteeringEngineClient`), steering inside vLLM's compiled model;
- vLLM's completion and chat handlers read a request's ``steering`` field right after vLLM rendered its
  prompts, check it against the model and every rendered prompt, and answer a bad one with HTTP 400 in
  OpenAI's error format before anything reaches the engine. Good specs ride the request's
  ``vllm_xargs`` into ``SamplingParams.extra_args``, where `SteeringEngineClient` takes them out and
  hands them to the steered engine (which adds the cache salt and the engine form);
- ``/v1/steering/vectors`` (POST, GET, DELETE): the `VectorRegistry` that specs name vectors from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
from collections.abc import AsyncGenerator, AsyncIterator
from http import HTTPStatus
from typing import Any

import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse
from vllm.usage.usage_lib import UsageContext

from ..engines.steered import AsyncSteeredVLLM, steered_engine_args
from ..steering import EXTRA_ARGS_KEY, Steering
from .fields import InvalidField, check_positions, checked_name, checked_vector, named_vectors, naming, read_steering
from .registry import Registry

#: ``SamplingParams.extra_args`` key of a request's checked `Steering` specs, between handler and engine client.
SPECS_KEY = f"{EXTRA_ARGS_KEY}_specs"
#: ``vllm_xargs`` keys a client may not send: they would reach the engine unchecked.
RESERVED_PREFIX = "nnterp_vllm"
VECTORS_PATH = "/v1/steering/vectors"


def error_response(message: str, param: str | None, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> ErrorResponse:
    """An error in OpenAI's format: ``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``."""
    return ErrorResponse(error=ErrorInfo(message=message, type="invalid_request_error", param=param, code=status.value))


def error_json(message: str, param: str | None, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> JSONResponse:
    """`error_response` as an HTTP response."""
    return JSONResponse(error_response(message, param, status).model_dump(), status_code=status.value)


class SteeringEngineClient(AsyncSteeredVLLM):
    """`AsyncSteeredVLLM` as vLLM's handlers call it: a request's checked specs arrive in its sampling params."""

    async def generate(
        self, prompt: Any, sampling_params: SamplingParams, request_id: str, *, steering: Any = None, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        """`AsyncSteeredVLLM.generate`, steered by the specs a handler left under `SPECS_KEY` (if any)."""
        extra = sampling_params.extra_args or {}
        if SPECS_KEY in extra:
            steering = extra[SPECS_KEY]
            # The params are this prompt's own (vLLM builds them per prompt); the dict may be the request's.
            sampling_params.extra_args = {key: value for key, value in extra.items() if key != SPECS_KEY} or None
        async for output in super().generate(prompt, sampling_params, request_id, steering=steering, **kwargs):
            yield output


class SteeringHandler:
    """Mixed in front of a vLLM completion or chat handler: reads and checks a request's ``steering``."""

    engine_client: SteeringEngineClient
    steering_registry: Registry

    async def steered(self, request: Any, rendered: Any, engine_inputs: list[dict]) -> Any:
        """``rendered`` (what vLLM's render step returned), or an `ErrorResponse` if the steering is bad.

        Good specs are left in ``request.vllm_xargs`` for `SteeringEngineClient`.
        """
        if isinstance(rendered, ErrorResponse):
            return rendered
        try:
            specs = await self._checked_specs(request, engine_inputs)
        except InvalidField as error:
            return error_response(str(error), error.param)
        if specs:
            request.vllm_xargs = {**(request.vllm_xargs or {}), SPECS_KEY: specs}
        return rendered

    async def _checked_specs(self, request: Any, engine_inputs: list[dict]) -> list[Steering]:
        reserved = [key for key in request.vllm_xargs or {} if key.startswith(RESERVED_PREFIX)]
        if reserved:
            raise InvalidField(
                f"vllm_xargs: {reserved[0]!r} is reserved for the server; send steering instead", "vllm_xargs"
            )
        field = (request.model_extra or {}).get("steering")
        if field is None or field == []:
            return []
        if request.use_beam_search:
            raise InvalidField("steering is not served with beam search (use_beam_search)", "use_beam_search")
        engine = self.engine_client
        registered = await self.steering_registry.call("get", sorted(named_vectors(field)))
        specs = read_steering(field, registered, engine.num_layers, engine.hidden_size)
        for i, engine_input in enumerate(engine_inputs):
            prompt = f"prompt {i}" if len(engine_inputs) > 1 else "the prompt"
            check_positions(specs, len(engine_input["prompt_token_ids"]), prompt)
            with naming("steering"):  # what only the whole request shows (e.g. rows of the steering table)
                engine.steered_request(engine_input, SamplingParams(), specs)
        return specs


class SteeringCompletions(SteeringHandler):
    """vLLM's ``OpenAIServingCompletion`` reading ``steering``."""

    async def render_completion_request(self, request: Any) -> Any:
        rendered = await super().render_completion_request(request)
        return await self.steered(request, rendered, rendered)


class SteeringChat(SteeringHandler):
    """vLLM's ``OpenAIServingChat`` reading ``steering``."""

    async def render_chat_request(self, request: Any) -> Any:
        rendered = await super().render_chat_request(request)
        return await self.steered(request, rendered, [] if isinstance(rendered, ErrorResponse) else rendered[1])


#: vLLM's app-state attribute of each handler that reads ``steering``, with its mixin.
HANDLERS = {"openai_serving_completion": SteeringCompletions, "openai_serving_chat": SteeringChat}

router = APIRouter()


def _steering(request: Request) -> tuple[Registry, int]:
    return request.app.state.steering_registry, request.app.state.engine_client.hidden_size


@router.post(VECTORS_PATH, status_code=HTTPStatus.CREATED.value)
async def register_vector(raw_request: Request) -> JSONResponse:
    """Register ``{"name", "vector"}``: 201; 200 if that name holds the same vector; 409 if another."""
    registry, hidden_size = _steering(raw_request)
    try:
        body = await raw_request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return error_json(f"the body is not JSON: {error}", None)
    if not isinstance(body, dict):
        return error_json(f"the body is an object {{'name', 'vector'}}, got {type(body).__name__}", None)
    try:
        for key in body:
            if key not in ("name", "vector"):
                raise InvalidField(f"unknown field {key!r}; a vector is registered with 'name' and 'vector'", key)
        with naming("name"):
            name = checked_name(body.get("name"))
        with naming("vector"):
            vector = checked_vector(body.get("vector"), hidden_size, "vector").to(torch.float32)
    except InvalidField as error:
        return error_json(str(error), error.param)
    outcome = await registry.call("add", name, vector)
    if outcome == "conflict":
        return error_json(
            f"another vector is registered as {name!r}; DELETE {VECTORS_PATH}/{name} first, or choose another name",
            "name",
            HTTPStatus.CONFLICT,
        )
    status = HTTPStatus.CREATED if outcome == "created" else HTTPStatus.OK
    return JSONResponse({"object": "steering.vector", "name": name, "size": hidden_size}, status_code=status.value)


@router.get(VECTORS_PATH)
async def list_vectors(raw_request: Request) -> JSONResponse:
    """The registered vectors: ``{"object": "list", "data": [{"name", "size"}, ...]}``."""
    registry, _ = _steering(raw_request)
    sizes = await registry.call("sizes")
    data = [{"object": "steering.vector", "name": name, "size": size} for name, size in sizes.items()]
    return JSONResponse({"object": "list", "data": data})


@router.delete(VECTORS_PATH + "/{name}")
async def delete_vector(name: str, raw_request: Request) -> JSONResponse:
    """Forget a registered vector (requests already admitted keep it); 404 if no vector has that name."""
    registry, _ = _steering(raw_request)
    if not await registry.call("remove", name):
        return error_json(f"no vector is registered as {name!r}", "name", HTTPStatus.NOT_FOUND)
    return JSONResponse({"object": "steering.vector.deleted", "name": name, "deleted": True})


class SteeringEndpoints:
    """The server's additions, as a vLLM endpoint plugin: the vector routes, steering on two handlers."""

    name = "nnterp_vllm_steering"
    required_tasks = ("generate",)

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def attach_router(self, app: FastAPI) -> None:
        """Add the ``/v1/steering/vectors`` routes."""
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: argparse.Namespace) -> None:
        """Give the app the registry, and vLLM's completion and chat handlers the steering step.

        The handlers vLLM built (with every argument as vLLM passes it) are re-classed in place over
        their steering mixin, which keeps their state and adds only the step after rendering.
        """
        state.steering_registry = self.registry
        for attribute, mixin in HANDLERS.items():
            handler = getattr(state, attribute, None)
            if handler is not None:
                handler.__class__ = type(mixin.__name__, (mixin, type(handler)), {"__doc__": mixin.__doc__})
                handler.steering_registry = self.registry


def engine_args(args: argparse.Namespace) -> AsyncEngineArgs:
    """The steered engine's arguments from the parsed command line (vLLM's engine arguments and ours)."""
    return steered_engine_args(AsyncEngineArgs.from_cli_args(args), args.steering_rows_per_request)


@contextlib.asynccontextmanager
async def steered_engine(arguments: AsyncEngineArgs, vllm_config: Any) -> AsyncIterator[SteeringEngineClient]:
    """The engine vLLM's server would build from ``arguments`` (as its ``build_async_engine_client`` does),
    steered; shut down on exit."""
    engine = SteeringEngineClient.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=arguments.enable_log_requests,
        aggregate_engine_logging=arguments.aggregate_engine_logging,
        disable_log_stats=arguments.disable_log_stats,
    )
    try:
        yield engine
    finally:
        engine.shutdown(timeout=vllm_config.shutdown_timeout)


async def build_app(engine: SteeringEngineClient, args: argparse.Namespace, registry: Registry) -> FastAPI:
    """vLLM's app (``build_app``, ``init_app_state``) over ``engine``, with `SteeringEndpoints` added."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app as build_vllm_app

    supported_tasks = await engine.get_supported_tasks()
    app = build_vllm_app(args, supported_tasks, engine.model_config)
    endpoints = SteeringEndpoints(registry)
    endpoints.attach_router(app)
    await init_app_state(engine, app.state, args, supported_tasks)
    await endpoints.init_state(engine, app.state, args)
    return app


async def run_server(
    args: argparse.Namespace, registry: Registry, arguments: AsyncEngineArgs, vllm_config: Any
) -> None:
    """Serve over HTTP until SIGTERM or SIGINT, as vLLM's ``run_server`` does (same socket setup, uvicorn
    settings and shutdown), with the steered engine and `SteeringEndpoints`."""
    from vllm import envs
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

    def interrupt_start(*_: Any) -> None:  # until uvicorn's handlers take over, as in vLLM's run_server
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, interrupt_start)
    listen_address, sock = setup_server(args, reuse_port=False)
    uvicorn_kwargs: dict[str, Any] = {}
    if (log_config := get_uvicorn_log_config(args)) is not None:
        uvicorn_kwargs["log_config"] = log_config
    async with steered_engine(arguments, vllm_config) as engine:
        app = await build_app(engine, args, registry)
        shutdown = await serve_http(
            app,
            sock=sock,
            enable_ssl_refresh=args.enable_ssl_refresh,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
            ssl_ciphers=args.ssl_ciphers,
            h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
            h11_max_header_count=args.h11_max_header_count,
            **uvicorn_kwargs,
        )
    try:
        await shutdown
    finally:
        sock.close()
