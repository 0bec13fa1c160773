"""vLLM's OpenAI-compatible server with per-request steering: the engine, the handlers and the extra routes.

The HTTP layer, protocol, argument parser, chat templates, streaming, errors and lifecycle are vLLM's
own (``vllm.entrypoints``); this module adds, in the shape of a vLLM endpoint plugin (`SteeringEndpoints`,
``vllm.plugins.endpoint_plugins``' contract: routes at app build, state at ``init_app_state``):

- the engine is `AsyncSteeredVLLM` (`SteeringEngineClient`), steering inside vLLM's compiled model;
- in front of vLLM's app, `GuardEveryRoute` (``--api-key`` on every route but the health probes) and
  `intake.RequestIntake`, which bounds request bodies and reads a request's ``steering`` field off the
  event loop (on the routes of `STEERING_ROUTES`; refused elsewhere);
- vLLM's handlers of those routes check the read specs against the model and every prompt they rendered,
  and answer a bad one with HTTP 400 in OpenAI's error format before anything reaches the engine. Good
  specs stay with the request (`intake.check`), where `SteeringEngineClient` hands them to the steered
  engine (which adds the cache salt and the engine form);
- ``/v1/steering/vectors`` (POST, GET, DELETE): the `VectorRegistry` that specs name vectors from;
- ``/v1/steering/models`` (POST, GET, DELETE) and ``/v1/models``: steered models, names a request asks for as
  ``model`` to be steered by their recipe (`steered_models`);
- a ``capture`` field (`Capture` as JSON) on the routes of `CAPTURE_ROUTES`, checked as ``steering`` is (and
  bounded by ``--max-capture-bytes``); the rows the engine kept come back in each choice's ``activations``:
  ``{name: {"shape", "dtype", "data": base64 of the raw little-endian bytes}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import re
import signal
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from http import HTTPStatus
from typing import Any

import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.usage.usage_lib import UsageContext

from ..engines.compile_cache import start_recompiling_once
from ..engines.steered.engine import AsyncSteeredVLLM
from ..engines.steered.steered_settings import steered_engine_args
from ..engines.steered.tensor_wire import pack
from ..specs.capture import Capture, kept_count
from ..specs.steering import Steering
from . import playground
from .capture_field import read_capture
from .errors import InvalidField, error_json, error_response, naming, refusal, registration_answer
from .guard import GuardEveryRoute, api_keys
from .intake import MAX_BODY_BYTES, RequestField, RequestIntake, check, checked, limit_message, record, taken
from .patch_sweep_body import read_patch_sweep
from .probes_field import read_probes
from .registry import Registry
from .steered_models import MODELS_PATH, SteeredModelCards, SteeredModelNames
from .steered_models import router as steered_models_router
from .steering_field import SPECS_PER_LAYER, check_positions, named_vectors, read_steering, with_vectors
from .traces import add_route, runs_no_edits
from .traces import body_bound as trace_body_bound
from .vector_registration import read_registration

STEERING = "steering"
#: The routes that serve ``steering``, each applying it as ``/v1/completions`` does (elsewhere it is refused).
STEERING_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/chat/completions/batch",
    "/v1/messages",
    "/v1/responses",
    "/invocations",
)
CAPTURE = "capture"
PROBES = "probes"
#: The routes that serve ``capture`` (answered whole, each choice with its ``activations``; elsewhere refused).
CAPTURE_ROUTES = ("/v1/completions", "/v1/chat/completions")
VECTORS_PATH = "/v1/steering/vectors"
#: The route answering an activation-patching sweep (`steering.patching.patch_sweep`) as JSON.
PATCH_SWEEP_PATH = "/v1/patch_sweep"
#: Bytes one number of a steering vector takes at most as JSON text (``-1.2345678901234567e-05, ``).
BYTES_PER_NUMBER = 25


class SteeringEngineClient(AsyncSteeredVLLM):
    """`AsyncSteeredVLLM` as vLLM's handlers call it: a request's checked specs and capture come with the request,
    and the rows it kept are recorded for its response; with ``--traces``, a request of the OpenAI routes runs no
    client's edit (`traces.runs_no_edits`)."""

    #: Whether the server runs traces (``--traces``), whose clients may leave edits on the engine.
    traces = False

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        steering: Any = None,
        capture: Capture | None = None,
        probes: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncGenerator[Any, None]:
        """`AsyncSteeredVLLM.generate`, steered by the specs, keeping what and reading the probes the request's
        handler checked."""
        steering = checked(STEERING) if steering is None else steering
        capture = checked(CAPTURE) if capture is None else capture
        probes = checked(PROBES) if probes is None else probes
        if self.traces:
            sampling_params = runs_no_edits(sampling_params)
        outputs = super().generate(
            prompt, sampling_params, request_id, steering=steering, capture=capture, probes=probes, **kwargs
        )
        async for output in outputs:
            if output.finished and getattr(output, "activations", None) is not None:
                record(CAPTURE, request_id, await asyncio.to_thread(encoded, output.activations))
            if output.finished and getattr(output, "probes", None) is not None:
                record(PROBES, request_id, {name: scores.tolist() for name, scores in output.probes.items()})
            yield output


def encoded(activations: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Kept rows as JSON: per value ``{"shape", "dtype", "data": base64 of the raw little-endian bytes}``."""
    result = {}
    for name, rows in activations.items():
        dtype, shape, data = pack(rows)
        result[name] = {"shape": shape, "dtype": dtype, "data": base64.b64encode(data).decode()}
    return result


def with_activations(body: dict[str, Any], recorded: dict[str, Any], key: str = "activations") -> None:
    """Put each request's kept rows (or what else it recorded, under ``key``) into its choice of a response
    ``body``: with several recorded, prompt ``i``'s (run as engine request ``<id>-<i>``) into choice ``i``; a lone
    one into the body's first choice (a whole response's only one, or a streamed chunk's choice it finishes)."""
    choices = body.get("choices") or []
    if len(recorded) == 1 and choices:
        (choices[0][key],) = recorded.values()
        return
    for request_id, found in recorded.items():
        if match := re.search(r"-(\d+)$", request_id):
            for choice in choices:
                if choice.get("index", 0) == int(match.group(1)):
                    choice[key] = found


def with_probes(body: dict[str, Any], recorded: dict[str, Any]) -> None:
    """Put each request's probe scores (per probe, one per kept token) into its choice of a response ``body``."""
    with_activations(body, recorded, PROBES)


class SteeringHandler:
    """Mixed in front of a vLLM handler: checks a request's ``steering`` against the prompts it rendered."""

    engine_client: SteeringEngineClient
    steering_registry: Registry
    max_capture_bytes: int

    async def steered(self, request: Any, rendered: Any, engine_inputs: Sequence[dict]) -> Any:
        """``rendered`` (what vLLM's render step returned), or an `ErrorResponse` if the steering is bad.

        Good specs are recorded for the request (`intake.check`), for `SteeringEngineClient`.
        """
        if isinstance(rendered, ErrorResponse):
            return rendered
        try:
            specs = await self._checked_specs(request, engine_inputs)
            capture = taken(CAPTURE)
            if capture is not None:
                await asyncio.to_thread(self._check_capture, request, capture, engine_inputs)
            probes = taken(PROBES)
            if probes is not None:
                await asyncio.to_thread(self._check_probes, request, probes, engine_inputs)
        except InvalidField as error:
            return error_response(str(error), error.param, error.status)
        if specs:
            check(STEERING, specs)
        if capture is not None:
            check(CAPTURE, capture)
        if probes is not None:
            check(PROBES, probes)
        return rendered

    def _check_probes(self, request: Any, probes: dict[str, Any], engine_inputs: Sequence[dict]) -> None:
        """Refuse probes the response cannot carry (several completions) or this engine cannot read (a layer it
        lacks, positions outside a prompt, more columns than it reads)."""
        if getattr(request, "n", 1) != 1:
            raise InvalidField(f"probes read one completion: send n=1, not n={request.n}", "n")
        for engine_input in engine_inputs:
            with naming(PROBES):
                length = len(engine_input.get("prompt_token_ids") or ())
                read = self.engine_client.probes_wire(probes, length)
                self.engine_client._check_pool(None, read, 0)

    def _check_capture(self, request: Any, capture: Capture, engine_inputs: Sequence[dict]) -> None:
        """Refuse a capture the response cannot carry: streamed, several completions, or more bytes of rows than
        ``--max-capture-bytes`` (counting every token the request may feed through the model)."""
        if getattr(request, "stream", False):
            raise InvalidField("capture is not served on streamed responses: send stream=false", "stream")
        if (getattr(request, "n", 1) or 1) != 1:
            raise InvalidField(f"capture keeps one completion's rows: send n=1, not n={request.n}", "n")
        engine = self.engine_client
        context = engine.model_config.max_model_len
        wanted = getattr(request, "max_completion_tokens", None) or getattr(request, "max_tokens", None)
        total = 0
        for i, engine_input in enumerate(engine_inputs):
            length = len(engine_input["prompt_token_ids"])
            with naming("capture.positions"):
                wire = capture.resolved(
                    engine.num_layers, engine.capture_values, length, engine.model_config.dtype, engine.held_saes
                )
            fed = length + (wanted or context - length) - 1
            itemsize = torch.empty((), dtype=getattr(torch, wire["dtype"])).element_size()
            total += kept_count(wire, fed) * len(wire["values"]) * engine.hidden_size * itemsize
            if total > self.max_capture_bytes:
                raise InvalidField(
                    f"capture: prompt {i} alone brings the rows this request may keep to {total} bytes, more than "
                    f"this server answers with ({self.max_capture_bytes} bytes, --max-capture-bytes): keep fewer "
                    "values or positions, lower max_tokens, or use float16",
                    CAPTURE,
                )

    async def _checked_specs(self, request: Any, engine_inputs: Sequence[dict]) -> list[Steering]:
        read = taken(STEERING)
        if not read:
            return []
        if getattr(request, "use_beam_search", False):
            raise InvalidField("steering is not served with beam search (use_beam_search)", "use_beam_search")
        registered = await self.steering_registry.call("get", sorted(named_vectors(read)))
        specs = with_vectors(read, registered, self.engine_client.saes)
        await asyncio.to_thread(self._check_prompts, specs, engine_inputs)
        return specs

    def _check_prompts(self, specs: list[Steering], engine_inputs: Sequence[dict]) -> None:
        for i, engine_input in enumerate(engine_inputs):
            prompt = f"prompt {i}" if len(engine_inputs) > 1 else "the prompt"
            check_positions(specs, len(engine_input["prompt_token_ids"]), prompt)
            with naming(STEERING):  # what only the whole request shows (the dtype's bound, the table's rows)
                self.engine_client.steered_request(engine_input, SamplingParams(), specs)


class SteeringCompletions(SteeringHandler):
    """vLLM's ``OpenAIServingCompletion`` (``/v1/completions``, ``/invocations``) reading ``steering``."""

    async def render_completion_request(self, request: Any) -> Any:
        rendered = await super().render_completion_request(request)
        return await self.steered(request, rendered, rendered)


class SteeringChat(SteeringHandler):
    """vLLM's ``OpenAIServingChat`` (``/v1/chat/completions``, ``/invocations``) and its Anthropic subclass
    (``/v1/messages``) reading ``steering``."""

    async def render_chat_request(self, request: Any) -> Any:
        rendered = await super().render_chat_request(request)
        return await self.steered(request, rendered, [] if isinstance(rendered, ErrorResponse) else rendered[1])


class SteeringChatBatch(SteeringHandler):
    """vLLM's ``OpenAIServingChatBatch`` (``/v1/chat/completions/batch``): every conversation steered alike."""

    async def render_batch_chat_request(self, request: Any) -> Any:
        rendered = await super().render_batch_chat_request(request)
        return await self.steered(request, rendered, [] if isinstance(rendered, ErrorResponse) else rendered[2])


class SteeringResponses(SteeringHandler):
    """vLLM's ``OpenAIServingResponses`` (``/v1/responses``): every turn of the response steered alike."""

    async def _render_resolved_response_inputs(self, request: Any, prev_response: Any, **kwargs: Any) -> Any:
        rendered = await super()._render_resolved_response_inputs(request, prev_response, **kwargs)
        inputs = [] if isinstance(rendered, ErrorResponse) else [rendered.engine_input]
        return await self.steered(request, rendered, inputs)


#: vLLM's app-state attribute of each handler that reads ``steering``, with its mixin.
HANDLERS = {
    "openai_serving_completion": SteeringCompletions,
    "openai_serving_chat": SteeringChat,
    "anthropic_serving_messages": SteeringChat,
    "openai_serving_chat_batch": SteeringChatBatch,
    "openai_serving_responses": SteeringResponses,
}

router = APIRouter()


def _steering(request: Request) -> tuple[Registry, int]:
    return request.app.state.steering_registry, request.app.state.engine_client.hidden_size


@router.post(VECTORS_PATH, status_code=HTTPStatus.CREATED.value)
async def register_vector(raw_request: Request) -> JSONResponse:
    """Register ``{"name", "vector"}``: 201; 200 if that name holds the same vector; 409 if another, or if the
    registry is full."""
    registry, hidden_size = _steering(raw_request)
    try:
        name, vector = await asyncio.to_thread(read_registration, await raw_request.body(), hidden_size)
    except InvalidField as error:
        return refusal(error)
    capacity = raw_request.app.state.args.max_steering_vectors
    return registration_answer(
        await registry.call("add", name, vector),
        f"another vector is registered as {name!r}; DELETE {VECTORS_PATH}/{name} first, or choose another name",
        f"the registry is full: it holds at most {capacity} vectors (--max-steering-vectors); DELETE "
        f"{VECTORS_PATH}/NAME one no longer needed, or send the vector inline",
        {"object": "steering.vector", "name": name, "size": hidden_size},
    )


@router.get(VECTORS_PATH)
async def list_vectors(raw_request: Request) -> JSONResponse:
    """The registered vectors: ``{"object": "list", "data": [{"name", "size"}, ...]}``."""
    registry, _ = _steering(raw_request)
    data = [{"object": "steering.vector", **entry} for entry in await registry.call("listing")]
    return JSONResponse({"object": "list", "data": data})


def missing_vector(name: str) -> JSONResponse:
    """The 404 of a route naming a vector the registry does not hold."""
    return error_json(
        f"no vector is registered as {name!r}; GET {VECTORS_PATH} lists those that are", "name", HTTPStatus.NOT_FOUND
    )


@router.get(VECTORS_PATH + "/{name}")
async def get_vector(name: str, raw_request: Request) -> JSONResponse:
    """A registered vector's values: ``{"object", "name", "size", "vector": [...]}``, or ``"layers": {layer:
    [...]}`` for one made per layer; 404 if no vector has that name."""
    registry, hidden_size = _steering(raw_request)
    vector = (await registry.call("get", [name])).get(name)
    if vector is None:
        return missing_vector(name)
    if isinstance(vector, dict):
        values = {"layers": {str(layer): one.tolist() for layer, one in sorted(vector.items())}}
    else:
        values = {"vector": vector.tolist()}
    return JSONResponse({"object": "steering.vector", "name": name, "size": hidden_size, **values})


@router.delete(VECTORS_PATH + "/{name}")
async def delete_vector(name: str, raw_request: Request) -> JSONResponse:
    """Forget a registered vector (requests already admitted keep it); 404 if no vector has that name."""
    registry, _ = _steering(raw_request)
    if not await registry.call("remove", name):
        return missing_vector(name)
    return JSONResponse({"object": "steering.vector.deleted", "name": name, "deleted": True})


@router.post(PATCH_SWEEP_PATH)
async def patch_sweep_route(raw_request: Request) -> JSONResponse:
    """An activation-patching sweep (`read_patch_sweep`'s body): every cell a request of the engine's continuous
    batch, its metric read in the worker; the table as JSON (`PatchSweep.as_dict`). 400 naming what is wrong."""
    from ..steering.patching import served_patch_sweep

    engine = raw_request.app.state.engine_client
    try:
        arguments = await asyncio.to_thread(read_patch_sweep, await raw_request.body())
        sweep = await served_patch_sweep(engine, **arguments)
    except InvalidField as error:
        return refusal(error)
    except ValueError as error:
        return error_json(str(error), None)
    return JSONResponse({"object": "patch_sweep", **sweep.as_dict()})


def steering_specs_bound(args: argparse.Namespace, num_layers: int) -> int:
    """Specs one request may carry: ``--max-steering-specs``, else `SPECS_PER_LAYER` per block of the model."""
    return args.max_steering_specs or SPECS_PER_LAYER * num_layers


def steering_reader(args: argparse.Namespace, num_layers: int, hidden_size: int) -> Callable[[Any], list[dict]]:
    """How this server reads a ``steering`` field, a request's or a steered model's recipe: `read_steering` with the
    model's sizes and the server's bounds (``--max-steering-specs``, ``--max-relative-dose``)."""
    return functools.partial(
        read_steering,
        num_layers=num_layers,
        hidden_size=hidden_size,
        max_specs=steering_specs_bound(args, num_layers),
        max_relative_dose=args.max_relative_dose,
    )


def body_bound(args: argparse.Namespace, max_specs: int, hidden_size: int) -> int:
    """Bytes of a request body the server reads: ``--max-request-body-bytes``, else `MAX_BODY_BYTES` plus
    what the most specs a request may carry take as JSON."""
    return args.max_request_body_bytes or MAX_BODY_BYTES + max_specs * hidden_size * BYTES_PER_NUMBER


class SteeringEndpoints:
    """The server's additions, as a vLLM endpoint plugin: the vector routes, steering on the generation
    handlers, and the guards in front of vLLM's app."""

    name = "nnterp_vllm_steering"
    required_tasks = ("generate",)

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def attach_router(self, app: FastAPI) -> None:
        """Add the ``/v1/steering/vectors`` and ``/v1/steering/models`` routes and the playground
        (`playground.attach`)."""
        app.include_router(router)
        app.include_router(steered_models_router)
        playground.attach(app)

    def attach_guards(self, app: FastAPI, engine: SteeringEngineClient, args: argparse.Namespace) -> None:
        """Put `RequestIntake` (body bound, ``steering`` read off the event loop) and, with ``--api-key``,
        `GuardEveryRoute` in front of everything vLLM's app does (the guard outermost)."""
        max_specs = steering_specs_bound(args, engine.num_layers)
        read = steering_reader(args, engine.num_layers, engine.hidden_size)
        capture = functools.partial(
            read_capture, num_layers=engine.num_layers, kept=engine.capture_values, saes=engine.held_saes
        )
        fields = [
            RequestField(STEERING, STEERING_ROUTES, read),
            RequestField(CAPTURE, CAPTURE_ROUTES, capture, with_activations),
            RequestField(
                PROBES, CAPTURE_ROUTES, functools.partial(read_probes, hidden_size=engine.hidden_size), with_probes
            ),
        ]
        # In front of the app's whole stack (vLLM's SageMaker bootstrap has built it already).
        stack = app.middleware_stack or app.build_middleware_stack()
        bound = body_bound(args, max_specs, engine.hidden_size)
        # A steered model's registration carries a recipe in the steering field's format, read by its own route.
        own_bounds = {MODELS_PATH: (bound, limit_message(bound)), **(trace_body_bound(args) if args.traces else {})}
        names = SteeredModelNames(self.registry, args.served_model_name or [args.model])
        app.state.steered_model_names = names
        app.state.read_steering = read
        stack = RequestIntake(stack, fields, bound, own_bounds, names, STEERING)
        if keys := api_keys(args):
            stack = GuardEveryRoute(stack, keys, args.metrics_without_api_key)
        app.middleware_stack = stack

    async def init_state(self, engine_client: Any, state: Any, args: argparse.Namespace) -> None:
        """Give the app the registry, and vLLM's generation handlers the steering step.

        The handlers vLLM built (with every argument as vLLM passes it) are re-classed in place over
        their steering mixin, which keeps their state and adds only the step after rendering.
        """
        state.steering_registry = self.registry
        models = state.openai_serving_models
        models.__class__ = type(
            f"Steered{type(models).__name__}", (SteeredModelCards, type(models)), {"__doc__": SteeredModelCards.__doc__}
        )
        models.steering_registry = self.registry
        for attribute, mixin in HANDLERS.items():
            handler = getattr(state, attribute, None)
            if handler is not None:
                name = f"Steering{type(handler).__name__}"
                handler.__class__ = type(name, (mixin, type(handler)), {"__doc__": mixin.__doc__})
                handler.steering_registry = self.registry
                handler.max_capture_bytes = args.max_capture_bytes


def engine_args(args: argparse.Namespace) -> AsyncEngineArgs:
    """The steered engine's arguments from the parsed command line (vLLM's engine arguments and ours)."""
    arguments = AsyncEngineArgs.from_cli_args(args)
    return steered_engine_args(
        arguments,
        args.capture_values,
        args.sae,
        args.steering_directions_per_block,
        args.max_steering_entries,
        args.max_probe_columns,
        steering_values=args.steering_values,
    )


@contextlib.asynccontextmanager
async def steered_engine(arguments: AsyncEngineArgs, vllm_config: Any) -> AsyncIterator[SteeringEngineClient]:
    """The engine vLLM's server would build from ``arguments`` (as its ``build_async_engine_client`` does),
    steered; shut down on exit."""
    engine = start_recompiling_once(
        lambda: SteeringEngineClient.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=arguments.enable_log_requests,
            aggregate_engine_logging=arguments.aggregate_engine_logging,
            disable_log_stats=arguments.disable_log_stats,
        )
    )
    try:
        await engine.check_capture_values()
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
    if args.traces:
        engine.traces = True
        add_route(app, args, engine)
    endpoints.attach_guards(app, engine, args)
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
