"""The steered engine's scheduler: vLLM's own, keeping steered generated tokens out of the prefix cache."""

from __future__ import annotations

from typing import Any

from ..steering.specs import EXTRA_ARGS_KEY, decode_only


class PromptCachingScheduler:
    """vLLM's scheduler (its asynchronous one where the engine schedules asynchronously) whose prefix cache takes
    no block holding a generated token of a request steered at generated tokens only.

    Such a request is not salted (`steering.specs.request_steering`): its prompt is computed as an unsteered one's and
    shared. The KV of its generated tokens is steered, though, and vLLM caches every full block, generated
    tokens included, under the tokens' own hashes; a later prompt repeating those tokens (a chat's next turn)
    would read them. So its cached blocks stop at its prompt.
    """

    def __new__(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        base = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler
        scheduler = base(vllm_config, *args, **kwargs)
        coordinator = scheduler.kv_cache_manager.coordinator
        cache_blocks = coordinator.cache_blocks

        def prompt_blocks_of_decode_steered(request: Any, num_computed_tokens: int) -> None:
            steering = (
                (request.sampling_params.extra_args or {}).get(EXTRA_ARGS_KEY) if request.sampling_params else None
            )
            if steering is not None and decode_only(steering):
                num_computed_tokens = min(num_computed_tokens, request.num_prompt_tokens)
            cache_blocks(request, num_computed_tokens)

        coordinator.cache_blocks = prompt_blocks_of_decode_steered
        return scheduler
