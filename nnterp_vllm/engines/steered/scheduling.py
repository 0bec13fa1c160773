"""The steered engine's scheduler: vLLM's own, placing each request's steering in the pool before it runs, keying
its prefix-cache blocks from the first position it steers, keeping steered generated tokens out of the cache, and
requests that run trace code apart from the others."""

from __future__ import annotations

import os
import time
from typing import Any

from ...remote import EDITS_KEY, TRACE_KEY
from ...specs.probes import EXTRA_ARGS_KEY as PROBES_KEY
from ...specs.steering_requests import EXTRA_ARGS_KEY, SALTED_FROM, decode_only
from .steered_settings import sizes_of
from .steering_pool import SteeringPool


def salt_from(request: Any, position: int, salt: str, block_size: int, hash_function: Any) -> None:
    """Key a request's prefix-cache blocks by ``salt`` from the block holding prompt ``position`` on: the blocks before
    keep the hashes vLLM gave them (shared with any request whose tokens there are computed alike), that block's
    hash takes the salt as one more extra key (beside vLLM's own), and every later one chains from it (as vLLM
    hashes the blocks the request adds as it generates)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens

    hashes = request.block_hashes
    first = position // block_size
    parent = hashes[first - 1] if first else None
    media = 0
    for index in range(first, len(hashes)):
        start = index * block_size
        extra, media = generate_block_hash_extra_keys(request, start, start + block_size, media)
        if index == first:
            extra = (*(extra or ()), ("nnterp_vllm_steering", salt))
        parent = hashes[index] = hash_block_tokens(
            hash_function, parent, request.all_token_ids[start : start + block_size], extra
        )


def request_steering_of(request: Any, key: str = EXTRA_ARGS_KEY) -> dict[str, Any] | None:
    """A scheduled request's steering in engine form (or what it carries under another ``key``: its probes), or
    ``None``."""
    params = request.sampling_params
    return (params.extra_args or {}).get(key) if params is not None else None


def carries_trace(request: Any) -> bool:
    """Whether a scheduled request runs trace code: its own block (nnsight's client puts it in ``extra_args``), or
    edits left on the engine that it names."""
    extra = (request.sampling_params.extra_args or {}) if request.sampling_params is not None else {}
    return TRACE_KEY in extra or bool(extra.get(EDITS_KEY))


#: The share of the engine's time steps running trace code take while requests that run none wait too.
TRACE_SHARE = 1 / 5


class TraceSteps:
    """Keeps requests that run trace code and requests that run none in separate steps, while both wait.

    A step with trace code in it runs eagerly (`runners`): every request in it would lose vLLM's compiled model (and
    its CUDA graphs), and the trace's code runs beside every token of the step. So while both kinds wait, each step
    takes one kind only, the one further below its share of the engine's time: `TRACE_SHARE` for the steps running
    trace code, the rest for the others (the OpenAI routes' requests, steered or not). Each step's time is measured
    from its schedule to the next and counted only for steps chosen while both waited (a kind that had the engine
    to itself earns no debt, and a moment with one kind waiting forgives none); the other kind's running requests
    sit the step out (vLLM's ``next_decode_eligible_step``), its waiting ones are passed over. With one kind
    waiting, every step is its.
    """

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.separate = os.environ.get("NNTERP_VLLM_TRACE_STEPS", "separate") == "separate"
        #: Engine seconds each kind (``True``: trace code) took in steps chosen while both waited.
        self.spent = {False: 0.0, True: 0.0}
        self.last: tuple[bool, float] | None = None
        #: The kind this step leaves out, or ``None``.
        self.left_out: bool | None = None

    def new_step(self) -> None:
        """Choose the kind of the step about to be scheduled, and have the other's running requests sit it out."""
        now = time.monotonic()
        if self.last is not None:
            kind, started = self.last
            self.spent[kind] += now - started
        self.last, self.left_out = None, None
        if not self.separate:
            return
        scheduler = self.scheduler
        waiting = {carries_trace(request) for request in [*scheduler.running, *scheduler.waiting]}
        if len(waiting) < 2:
            return
        kind = self.spent[True] / TRACE_SHARE < self.spent[False] / (1 - TRACE_SHARE)
        self.last, self.left_out = (kind, now), not kind
        for request in scheduler.running:
            if carries_trace(request) != kind:
                # vLLM's scheduler passes over a running request until the step this names.
                request.next_decode_eligible_step = max(request.next_decode_eligible_step, scheduler.current_step + 2)

    def admits(self, request: Any) -> bool:
        """Whether a waiting ``request`` may be scheduled in this step."""
        return self.left_out is None or carries_trace(request) != self.left_out


class PromptCachingScheduler:
    """vLLM's scheduler (its asynchronous one where the engine schedules asynchronously) with the steering pool
    (`steering_pool.SteeringPool`) and a prefix cache that takes no block holding a generated token of a request
    steered at generated tokens only.

    A waiting request is scheduled only once its steering is placed in the pool: until its rows and entries fit,
    it is passed over as vLLM passes over a request whose grammar is not compiled yet, and its turn comes back at
    the next step. Its ids go back as vLLM frees the request.

    A request steered at listed prompt positions only, the first ``p``, has its prompt's prefix-cache blocks salted
    from the block holding ``p`` on (`salt_from`), where vLLM's own cache salt would key them all: the blocks
    before ``p`` are computed as an unsteered request's and shared with it.

    A request steered at generated tokens only is not salted (`specs.steering_requests.request_steering`): its prompt is
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
        pool = SteeringPool(
            sizes.num_layers, sizes.steering_rows, sizes.steering_entries, sizes.steering_writes, sizes.probe_columns
        )
        schedule, ready, free = scheduler.schedule, scheduler._handle_blocked_waiting_request, scheduler._free_request

        kinds = TraceSteps(scheduler)

        def schedule_placing(*args: Any, **kwargs: Any) -> Any:
            pool.new_step()
            kinds.new_step()
            return schedule(*args, **kwargs)

        def ready_and_placed(request: Any) -> bool:
            if not kinds.admits(request):
                return False
            probes = request_steering_of(request, PROBES_KEY)
            return ready(request) and pool.admit(request.request_id, request_steering_of(request), probes)

        def free_and_release(request: Any, *args: Any, **kwargs: Any) -> Any:
            pool.release(request.request_id)
            return free(request, *args, **kwargs)

        scheduler.schedule, scheduler._free_request = schedule_placing, free_and_release
        scheduler._handle_blocked_waiting_request = ready_and_placed
        scheduler.steering_pool = pool

        if vllm_config.cache_config.enable_prefix_caching:
            from vllm.utils.hashing import get_hash_fn_by_name

            hash_function = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
            add_request = scheduler.add_request

            def add_salted(request: Any) -> None:
                steering = request_steering_of(request)
                if steering is not None and SALTED_FROM in steering and request.block_hashes:
                    salt_from(request, *steering[SALTED_FROM], scheduler.hash_block_size, hash_function)
                add_request(request)

            scheduler.add_request = add_salted

        coordinator = scheduler.kv_cache_manager.coordinator
        cache_blocks = coordinator.cache_blocks

        def prompt_blocks_of_decode_steered(request: Any, num_computed_tokens: int) -> None:
            steering = request_steering_of(request)
            if steering is not None and decode_only(steering):
                num_computed_tokens = min(num_computed_tokens, request.num_prompt_tokens)
            cache_blocks(request, num_computed_tokens)

        coordinator.cache_blocks = prompt_blocks_of_decode_steered
        return scheduler
