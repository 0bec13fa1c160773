"""``--replicas N``: N steering servers behind one endpoint, on Ray Serve.

Each replica is a Ray Serve deployment replica holding its own steered engine and vLLM's app over it
(the same `build_app` as the single server); Ray Serve's HTTP proxy listens on ``--host``/``--port`` and
spreads requests over the replicas. The vector registry is one more deployment (one replica, no CPU
reserved) that every replica asks, so a vector or steered model registered through any replica steers on all of
them.
The process that runs this is the driver: it starts a local Ray cluster unless ``--ray-address`` names
one (`ray_cluster.connected`: loopback, no token under the home directory, nothing left behind), and on
SIGTERM or SIGINT shuts Serve down (replicas drain their requests, then stop their engines) and then Ray.
"""

from __future__ import annotations

import argparse
import signal
from typing import Any

import torch

from .registry import Registry, VectorRegistry

#: Requests one replica takes at once; vLLM's scheduler queues and batches them (Serve's default is 5).
MAX_ONGOING_REQUESTS = 1024
APP_NAME = "nnterp-vllm"


class SteeringReplica:
    """One replica: the steered engine of the command line's arguments and vLLM's app over it."""

    async def __init__(self, argv: list[str], registry: Any) -> None:
        from vllm.usage.usage_lib import UsageContext

        from .command_line import parse
        from .server import build_app, engine_args, steered_engine

        args = parse(argv)
        arguments = engine_args(args)
        vllm_config = arguments.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        self._engine = steered_engine(arguments, vllm_config)
        engine = await self._engine.__aenter__()
        self._app = await build_app(engine, args, Registry(registry))

    async def __serve_build_asgi_app__(self) -> Any:
        return self._app

    async def __del__(self) -> None:
        await self._engine.__aexit__(None, None, None)


def run_replicas(
    args: argparse.Namespace, argv: list[str], vectors: dict[str, torch.Tensor], models: dict[str, Any]
) -> int:
    """Serve ``args.replicas`` replicas of ``argv``'s server at ``args.host:args.port`` until SIGTERM/SIGINT."""
    from ..ray_cluster import connected

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGINT, interrupt)
    setup = {"worker_process_setup_hook": f"{__package__}.prepare_ray_worker"}
    with connected(args.ray_address, include_dashboard=False, runtime_env=setup):
        signal.signal(signal.SIGTERM, interrupt)  # ray.init installs its own (exit at once, status 15)
        _serve(args, argv, vectors, models)
    return 0


def _serve(args: argparse.Namespace, argv: list[str], vectors: dict[str, torch.Tensor], models: dict[str, Any]) -> None:
    from ray import serve

    from ..engines.vllm_platform import is_cpu_platform

    try:
        serve.start(http_options={"host": args.host or "0.0.0.0", "port": args.port})
        registry = serve.deployment(VectorRegistry, name="SteeringVectors", ray_actor_options={"num_cpus": 0})
        if is_cpu_platform():
            resources = {"num_cpus": 1}
        else:
            resources = {"num_gpus": args.tensor_parallel_size * args.pipeline_parallel_size}
        replica = serve.deployment(
            serve.ingress()(SteeringReplica),
            name="SteeringServer",
            num_replicas=args.replicas,
            max_ongoing_requests=MAX_ONGOING_REQUESTS,
            ray_actor_options=resources,
        )
        serve.run(
            replica.bind(argv, registry.bind(vectors, args.max_steering_vectors, models)),
            name=APP_NAME,
            route_prefix="/",
        )
        print(f"nnterp-vllm serve: {args.replicas} replicas on http://{args.host or '0.0.0.0'}:{args.port}", flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the shutdown short
            signal.signal(signum, signal.SIG_IGN)
        serve.shutdown()
