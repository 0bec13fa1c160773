"""``nnterp-vllm serve``: vLLM's OpenAI-compatible server where every request may carry its own steering.

``nnterp-vllm serve MODEL [vLLM engine and server arguments] [--steering-vectors FILE] [--steered-model NAME=RECIPE]
[--replicas N]``
takes every argument ``vllm serve`` takes (vLLM's own parser) and serves what ``vllm serve`` serves,
with the ``steering`` request field on its generation routes (``/v1/completions``, ``/v1/chat/completions``,
``/v1/chat/completions/batch``, ``/v1/messages``, ``/v1/responses``, ``/invocations``) and the vector
registry at ``/v1/steering/vectors`` (`server`); a steered model's name as ``model`` steers by its recipe
(`steered_models`). ``--replicas N`` runs N replicas behind one endpoint
on Ray Serve (`replicas`). ``--traces`` also runs nnsight traces sent with ``model.trace(..., serve=url,
api_key=key)`` (`traces`). Importing this package loads no vLLM; `main` does.
"""

from __future__ import annotations

from collections.abc import Sequence


def prepare_ray_worker() -> None:
    """Ray's ``worker_process_setup_hook`` for ``--replicas``: importing ``nnterp_vllm`` is the preparation.

    A Ray worker unpickles the actor classes of a driver that has imported nnsight, which imports
    nnsight there before any of our code runs (anyio's attribute sets would then fail to define, see
    ``nnterp_vllm/__init__.py``); the hook runs first.
    """


def main(argv: Sequence[str]) -> int:
    """Run the server until SIGTERM or SIGINT (in-flight requests drain for --shutdown-timeout seconds)."""
    import uvloop
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.usage.usage_lib import UsageContext

    from .command_line import parse
    from .registry import Registry, VectorRegistry
    from .server import engine_args, run_server, steering_reader
    from .steered_models import read_steered_model_sources
    from .vector_registration import read_vector_sources

    cli_env_setup()
    args = parse(argv)
    configure_logging_from_args(args)
    arguments = engine_args(args)
    vllm_config = arguments.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    hidden_size = vllm_config.model_config.get_hidden_size()
    capacity = args.max_steering_vectors
    vectors = read_vector_sources(args.steering_vectors or [], hidden_size, capacity)
    models = read_steered_model_sources(
        args.steered_model or [],
        steering_reader(args, vllm_config.model_config.hf_text_config.num_hidden_layers, hidden_size),
        vectors,
        {sae.name: sae for sae in args.sae},
        args.served_model_name or [args.model],
    )
    if args.replicas > 1:
        from .replicas import run_replicas

        return run_replicas(args, list(argv), vectors, models)
    uvloop.run(run_server(args, Registry(VectorRegistry(vectors, capacity, models)), arguments, vllm_config))
    return 0
