"""The steered engine's scheduler: vLLM's own, placing each request's steering in the pool before it runs and
keeping steered generated tokens out of the prefix cache."""

from __future__ import annotations

from typing import Any

from ..steering.specs import EXTRA_ARGS_KEY, decode_only
from .memory import sizes_of
from .steering_pool import SteeringPool


def request_steering_of(request: Any) -> dict[str, Any] | None:
    """A scheduled request's steering in engine form, or ``None``."""
    params = request.sampling_params
    return (params.extra_args or {}).get(EXTRA_ARGS_KEY) if params is not None else None


class PromptCachingScheduler:
    """vLLM's scheduler (its asynchronous one where the engine schedules asynchronously) with the steering pool
    (`steering_pool.SteeringPool`) and a prefix cache that takes no block holding a generated token of a request
    steered at generated tokens only.

    A waiting request is scheduled only once its steering is placed in the pool: until its rows and entries fit,
    it is passed over as vLLM passes over a request whose grammar is not compiled yet, and its turn comes back at
    the next step. Its ids go back as vLLM frees the request.

    A request steered at generated tokens only is not salted (`steering.specs.request_steering`): its prompt is
    computed as an unsteered one's and shared. The KV of its generated tokens is steered, though, and vLLM caches
    every full block, generated tokens included, under the tokens' own hashes; a later prompt repeating those
    tokens (a chat's next turn) would read them. So its cached blocks stop at its prompt.
    """

    def __new__(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        base = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler
        scheduler = base(vllm_config, *args, **kwargs)
        sizes = sizes_of(vllm_config, accelerator=False, keeps_rows=False)
        pool = SteeringPool(sizes.num_layers, sizes.steering_rows, sizes.steering_entries, sizes.steering_writes)
        schedule, ready, free = scheduler.schedule, scheduler._handle_blocked_waiting_request, scheduler._free_request

        def schedule_placing(*args: Any, **kwargs: Any) -> Any:
            pool.new_step()
            return schedule(*args, **kwargs)

        def ready_and_placed(request: Any) -> bool:
            return ready(request) and pool.admit(request.request_id, request_steering_of(request))

        def free_and_release(request: Any, *args: Any, **kwargs: Any) -> Any:
            pool.release(request.request_id)
            return free(request, *args, **kwargs)

        scheduler.schedule, scheduler._free_request = schedule_placing, free_and_release
        scheduler._handle_blocked_waiting_request = ready_and_placed
        scheduler.steering_pool = pool

        coordinator = scheduler.kv_cache_manager.coordinator
        cache_blocks = coordinator.cache_blocks

        def prompt_blocks_of_decode_steered(request: Any, num_computed_tokens: int) -> None:
            steering = request_steering_of(request)
            if steering is not None and decode_only(steering):
                num_computed_tokens = min(num_computed_tokens, request.num_prompt_tokens)
            cache_blocks(request, num_computed_tokens)

        coordinator.cache_blocks = prompt_blocks_of_decode_steered
        return scheduler
