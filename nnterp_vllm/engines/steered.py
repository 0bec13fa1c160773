"""`SteeredVLLM` and `AsyncSteeredVLLM`: vLLM's own ``LLM`` and ``AsyncLLM`` with steering compiled into the model.

Each request may carry `Steering` specs. In the engine, one static operation at every standardized
block's ``layer_output`` (located through the model's family in ``families/vllm/``, so exactly where
`Standardized.steer` adds) adds ``table[layer][row_of_token]``: ``table`` is a ``[layers, rows, hidden]``
buffer whose row 0 stays zero, ``row_of_token`` a ``[max_num_batched_tokens]`` index. Both are
allocated once, before vLLM compiles the model, and refilled in place before each step from the
scheduled requests (their specs ride ``SamplingParams.extra_args``) and each token's position, so
the compiled graph (and CUDA graphs on GPUs) serve every step and any mix of requests: prompt and
generated tokens, chunked prefill, requests joining, leaving or preempted and recomputed.

The worker is vLLM's own for the platform (its ``CPUWorker`` on the CPU build, its GPU ``Worker``
elsewhere) with the model runner re-classed over `SteeringModelRunner`. A steered request's prompt
carries a ``cache_salt`` digesting its steering, so prefix-cache blocks are shared only between
requests steered alike (unsteered ones share with each other, as on plain vLLM). The compile cache
is keyed apart from plain vLLM's through ``additional_config``.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import inspect
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.outputs import RequestOutput
from vllm.v1.engine.async_llm import AsyncLLM

from .. import capture as capture_specs
from .. import families
from ..capture import Capture, kept_count, reads_prompt_from_cache
from ..components import first_tensor
from ..components import values as values_module
from ..components import vllm as on_vllm
from ..errors import UnsupportedFamily
from ..standardized import Standardized
from ..steering import (
    EXTRA_ARGS_KEY,
    Steering,
    TokenSets,
    decode_only,
    per_prompt,
    request_steering,
    specs_of,
    token_sets,
)
from . import capture as in_engine_capture
from . import containment
from .capture import CAPTURE_SETTING, Capturer, unpack
from .closed import refuse_after_shutdown, shut_down_llm
from .compile_cache import start_recompiling_once
from .vllm_platform import (
    TAKEN,
    blocks_to_run,
    built_on_access,
    engine_kwargs,
    is_cpu_platform,
    publish,
    remove_socket_directory,
    run_first_blocks,
    socket_directory,
)

#: ``additional_config`` key of the engine's steering settings (it also keys vLLM's compile cache).
CONFIG_KEY = "nnterp_vllm_steering"
#: Distinct steering rows one request may need unless the engine is built with another number.
ROWS_PER_REQUEST = 2
#: vLLM engine arguments the steered engine sets itself or cannot serve.
_REFUSED = {
    "worker_cls": "the steered engine runs its own worker (vLLM's worker for the platform, re-classed runner)",
    "scheduler_cls": "the steered engine runs vLLM's own scheduler, keeping steered generated tokens out of its cache",
    "speculative_config": "draft tokens would need their own steering rows; speculative decoding is not supported",
    "pipeline_parallel_size": "every rank holds every block's steering; pipeline parallelism is not supported",
}
#: Dotted paths of the worker classes vLLM instantiates in each worker process, by platform.
WORKERS = {"cpu": f"{__name__}.SteeringCPUWorker", "gpu": f"{__name__}.SteeringGPUWorker"}
_WORKER_CLASSES = ("SteeringCPUWorker", "SteeringGPUWorker", "SteeringCPUModelRunner", "SteeringGPUModelRunner")

#: How many times a steering operation ran as Python rather than inside a compiled graph, in this process.
EAGER_CALLS = 0


# -- worker side --------------------------------------------------------------------------------------


class SteeringTable(torch.nn.Module):
    """The per-step steering buffers: ``table [layers, rows, hidden]`` (row 0 zeros) and ``row_of_token``.

    Registered on every steered block (non-persistent buffers: no weight file names them), so the
    compiled graph reads them as inputs at stable module paths; they are only ever written in place.
    """

    def __init__(self, layers: int, rows: int, tokens: int, hidden: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        with torch.inference_mode(False):
            self.register_buffer("table", torch.zeros(layers, rows, hidden, dtype=dtype, device=device), False)
            self.register_buffer("row_of_token", torch.zeros(tokens, dtype=torch.long, device=device), False)

    def delta(self, layer: int, tokens: int) -> torch.Tensor:
        """``[tokens, hidden]``: each token's vector at ``layer``."""
        return self.table[layer].index_select(0, self.row_of_token[:tokens])


def steer_block(block: torch.nn.Module, args: Any, output: Any) -> Any:
    """Forward hook of a steered block: its output with each token's steering vector added to the stream."""
    global EAGER_CALLS
    if not torch.compiler.is_compiling():  # folded away when traced: counts only runs outside a compiled graph
        EAGER_CALLS += 1
    tokens = first_tensor(output).shape[0]
    return block.nnterp_layer_output.with_added(output, block.nnterp_steering.delta(block.nnterp_layer, tokens))


def steered_blocks(model: torch.nn.Module, model_type: str) -> list[tuple[torch.nn.Module, Any]]:
    """The standardized blocks of a vLLM model in order, each with its family's ``layer_output`` value."""
    family = families.lookup(model_type, engine=families.VLLM)
    container = next((path for path, name in family.RENAME.items() if "layers" in _names(name)), None)
    try:
        blocks = model.get_submodule(container) if container else None
    except AttributeError:
        blocks = None
    if blocks is None:
        raise UnsupportedFamily(f"{family.__name__}: no module {container!r} holds the blocks of {type(model)}")
    found = []
    for block in blocks:
        envoy = next((family.ENVOYS[cls] for cls in type(block).__mro__ if cls in family.ENVOYS), None)
        value = getattr(envoy, "layer_output", None)
        if not isinstance(value, on_vllm.Flat) or value.key != "output":
            raise UnsupportedFamily(
                f"{family.__name__} serves layer_output of {type(block).__name__} elsewhere than its output; "
                "the steered engine adds at a block's output"
            )
        found.append((block, value))
    return found


def _names(name: Any) -> list[str]:
    return name if isinstance(name, list) else [name]


@dataclasses.dataclass
class RequestRows:
    """A steered request, as the runner keeps it: its token sets, each named by the key of its row content."""

    tokens: TokenSets
    prompt: tuple | None
    generated: tuple | None
    listed: dict[int, tuple | None]


class Steerer:
    """Installs the steering operation on a loaded model and fills its buffers before each step."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, device: torch.device) -> None:
        model_config, scheduler = vllm_config.model_config, vllm_config.scheduler_config
        settings = vllm_config.additional_config[CONFIG_KEY]
        blocks = steered_blocks(model, Standardized._model_type(model_config.hf_config))
        if len(blocks) != model_config.hf_text_config.num_hidden_layers:
            raise UnsupportedFamily(
                f"found {len(blocks)} blocks in {type(model).__name__}, but its config has "
                f"num_hidden_layers={model_config.hf_text_config.num_hidden_layers}"
            )
        hidden = model_config.get_hidden_size()
        tokens = scheduler.max_num_batched_tokens
        rows = 1 + min(tokens, settings["rows_per_request"] * scheduler.max_num_seqs)
        self.buffers = SteeringTable(len(blocks), rows, tokens, hidden, model_config.dtype, device)
        for index, (block, value) in enumerate(blocks):
            block.nnterp_steering = self.buffers
            block.nnterp_layer = index
            block.nnterp_layer_output = value
            block.register_forward_hook(steer_block)
        self.num_layers, self.hidden = len(blocks), hidden
        # On an accelerator the rows are written on the host (pinned) and copied over each step.
        self.host_rows = (
            self.buffers.row_of_token
            if device.type == "cpu"
            else torch.zeros(tokens, dtype=torch.long, pin_memory=True)
        )
        self.host_rows_np = self.host_rows.numpy()
        self.written = 0
        self.requests: dict[str, RequestRows | None] = {}
        #: Row content by key (a sorted tuple of spec digests), for the keys of live requests.
        self.contents: dict[tuple, list[tuple[list[int], float, list[float]]]] = {}
        self.users: collections.Counter = collections.Counter()
        #: Resident rows by content key, least recently used first; free rows.
        self.row_of_key: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        self.free_rows = list(range(rows - 1, 0, -1))
        self.row_writes = 0

    # -- requests -------------------------------------------------------------------------------------

    def request(self, request_id: str, state: Any) -> RequestRows | None:
        """The steering of a scheduled request (parsed once from its sampling params)."""
        if request_id in self.requests:
            return self.requests[request_id]
        extra = getattr(state.sampling_params, "extra_args", None) or {}
        wire = extra.get(EXTRA_ARGS_KEY)
        rows = None
        if wire is not None:
            tokens = token_sets(wire)
            specs = [(spec["layers"], spec["factor"], spec["vector"]) for spec in wire["specs"]]

            def key(indices: tuple[int, ...]) -> tuple | None:
                if not indices:
                    return None
                named = tuple(sorted(wire["digests"][i] for i in indices))
                if named not in self.contents:
                    self.contents[named] = [specs[i] for i in sorted(indices, key=lambda i: wire["digests"][i])]
                self.users[named] += 1
                return named

            listed = {position: key(indices) for position, indices in tokens.listed.items()}
            rows = RequestRows(tokens, key(tokens.prompt), key(tokens.generated), listed)
        self.requests[request_id] = rows
        return rows

    def forget(self, request_id: str) -> None:
        """Drop a finished request; its rows stay resident until another key needs the room."""
        rows = self.requests.pop(request_id, None)
        if rows is None:
            return
        for named in self._keys(rows):
            self.users[named] -= 1
            if self.users[named] <= 0:
                del self.users[named], self.contents[named]

    # -- per step -------------------------------------------------------------------------------------

    def fill(self, request_ids: Sequence[str], scheduled: np.ndarray, computed: np.ndarray, states: dict) -> None:
        """Set each scheduled token's row, writing the rows of contents not resident yet.

        Tokens are laid out as vLLM lays them: the input batch's requests in order, each its
        ``scheduled[i]`` tokens at positions ``computed[i]`` onwards.
        """
        plan = []
        offset = 0
        for i, request_id in enumerate(request_ids):
            rows = self.request(request_id, states[request_id])
            if rows is not None:
                plan.append((offset, int(computed[i]), int(scheduled[i]), rows))
            offset += int(scheduled[i])
        if not plan and not self.written:
            return
        needed = {named for *_, rows in plan for named in self._keys(rows)}
        row = {named: self._resident(named, needed) for named in needed}
        target = self.host_rows_np
        dirty = max(offset, self.written)  # rows beyond this step's tokens (padding) must read row 0 too
        target[:dirty] = 0
        for start, position, count, rows in plan:
            self._mark(target, start, position, count, rows, row)
        self.written = offset if plan else 0
        if self.host_rows is not self.buffers.row_of_token:
            self.buffers.row_of_token[:dirty].copy_(self.host_rows[:dirty], non_blocking=True)

    @staticmethod
    def _keys(rows: RequestRows) -> list[tuple]:
        return [named for named in (rows.prompt, rows.generated, *rows.listed.values()) if named is not None]

    def _mark(self, target: np.ndarray, start: int, position: int, count: int, rows: RequestRows, row: dict) -> None:
        """Rows of one request's ``count`` tokens from ``position``, laid out from ``start``."""
        length = rows.tokens.prompt_length
        end = position + count
        prompt_end = min(end, length)
        if position < prompt_end:
            if rows.prompt is not None:
                target[start : start + prompt_end - position] = row[rows.prompt]
            for listed, named in rows.listed.items():
                if position <= listed < prompt_end and named is not None:
                    target[start + listed - position] = row[named]
        if end > length and rows.generated is not None:
            first = max(position, length)
            target[start + first - position : start + count] = row[rows.generated]

    def _resident(self, named: tuple, needed: set) -> int:
        """The row holding ``named``'s content, written into a free or least recently used row if need be."""
        if named in self.row_of_key:
            self.row_of_key.move_to_end(named)
            return self.row_of_key[named]
        if self.free_rows:
            row = self.free_rows.pop()
        else:
            evicted = next(key for key in self.row_of_key if key not in needed)
            row = self.row_of_key.pop(evicted)
        content = torch.zeros(self.num_layers, self.hidden, dtype=torch.float32)
        for layers, factor, vector in self.contents[named]:
            content[layers] += factor * torch.tensor(vector, dtype=torch.float32)
        self.buffers.table[:, row].copy_(content.to(self.buffers.table.dtype))
        self.row_of_key[named] = row
        self.row_writes += 1
        return row

    def stats(self) -> dict[str, Any]:
        """What a test or benchmark reads: eager runs of the operation, rows, and vLLM's compile counters."""
        from torch._dynamo.utils import counters
        from vllm.compilation.counter import compilation_counter

        return {
            "eager_calls": EAGER_CALLS,
            "rows": self.buffers.table.shape[1],
            "resident_rows": len(self.row_of_key),
            "row_writes": self.row_writes,
            "live_requests": len(self.requests),
            "compilation": dataclasses.asdict(compilation_counter),
            "dynamo_unique_graphs": counters["stats"]["unique_graphs"],
        }


class SteeringModelRunner:
    """Mixed in front of vLLM's model runner: installs the steering and capture operations at load, fills the
    steering table and lays out the kept rows before each step, copies the kept rows out after it."""

    _steerer: Steerer
    _capturer: Capturer

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Load as vLLM does, then keep its KV cache finite (`containment`) and add the operations before anything
        compiles the model (steering first, so a value kept at a steered block's output is the steered stream)."""
        super().load_model(*args, **kwargs)
        containment.keep_kv_cache_finite(self.model)
        run_first_blocks(self.model, self.vllm_config)
        self._steerer = Steerer(self.model, self.vllm_config, self.device)
        names = self.vllm_config.additional_config[CONFIG_KEY].get(CAPTURE_SETTING, [])
        self._capturer = Capturer(self.model, self.vllm_config, self.device, names)

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        prepared = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        batch = self.input_batch
        self._steerer.fill(batch.req_ids, num_scheduled_tokens, batch.num_computed_tokens_cpu, self.requests)
        self._capturer.plan(batch.req_ids, num_scheduled_tokens, batch.num_computed_tokens_cpu, self.requests)
        return prepared

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        output = super().execute_model(*args, **kwargs)
        self._capturer.gather()
        return output

    def _on_request_state_removed(self, req_id: str, req_state: Any) -> None:
        super()._on_request_state_removed(req_id, req_state)
        self._steerer.forget(req_id)
        self._capturer.forget(req_id)


def _define_worker_classes() -> None:
    """Build the steering worker and runner of this platform into this module."""
    if is_cpu_platform():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner as Runner
        from vllm.v1.worker.cpu_worker import CPUWorker as Worker

        names = ("SteeringCPUModelRunner", "SteeringCPUWorker")
    else:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as Runner
        from vllm.v1.worker.gpu_worker import Worker

        names = ("SteeringGPUModelRunner", "SteeringGPUWorker")

    runner_class = type(names[0], (SteeringModelRunner, Runner), {"__doc__": f"vLLM's {Runner.__name__}, steering."})

    def init_device(self: Any) -> None:
        Worker.init_device(self)
        if type(self.model_runner) is not Runner:
            raise NotImplementedError(
                f"the steered engine extends vLLM's V1 {Runner.__name__}, but this worker built "
                f"{type(self.model_runner).__name__}. Unset VLLM_USE_V2_MODEL_RUNNER."
            )
        self.model_runner.__class__ = runner_class

    def steering_stats(self: Any) -> dict[str, Any]:
        return self.model_runner._steerer.stats()

    def capture_stats(self: Any) -> dict[str, Any]:
        return self.model_runner._capturer.stats()

    def capture_places(self: Any) -> dict[str, Any]:
        capturer = self.model_runner._capturer
        return {"reasons": capturer.reasons, "places": capturer.places}

    def take_captured(self: Any, keys: Sequence[str], packed: bool) -> dict[str, Any]:
        return self.model_runner._capturer.take(keys, packed)

    worker_class = type(
        names[1],
        (Worker,),
        {
            "__doc__": f"vLLM's {Worker.__name__} whose runner steers and captures.",
            "init_device": init_device,
            "steering_stats": steering_stats,
            "capture_stats": capture_stats,
            "capture_places": capture_places,
            "take_captured": take_captured,
        },
    )
    publish(globals(), runner_class, worker_class)


#: The worker classes are built on first access, in whichever process vLLM imports them.
__getattr__ = built_on_access(globals(), _WORKER_CLASSES, _define_worker_classes)


# -- scheduler side -----------------------------------------------------------------------------------


class PromptCachingScheduler:
    """vLLM's scheduler (its asynchronous one where the engine schedules asynchronously) whose prefix cache takes
    no block holding a generated token of a request steered at generated tokens only.

    Such a request is not salted (`steering.request_steering`): its prompt is computed as an unsteered one's and
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


# -- client side --------------------------------------------------------------------------------------


def steering_settings(
    model: Any, given: dict[str, Any], rows_per_request: int = ROWS_PER_REQUEST, capture_values: Any = None
) -> dict:
    """The vLLM engine arguments a steered engine of ``model`` adds to the caller's ``given`` ones.

    The steering worker, its settings in ``additional_config`` (the values it keeps, ``capture_values``,
    among them; they also key vLLM's compile cache apart from plain vLLM's) and this platform's defaults
    (`engine_kwargs`). Refuses what the steered engine cannot serve, a model no vLLM family serves, and
    values it cannot keep, before anything loads.
    """
    refused = {
        "worker_cls": given.get("worker_cls") not in (None, "auto"),
        "scheduler_cls": given.get("scheduler_cls") is not None,
        "speculative_config": given.get("speculative_config") is not None or given.get("spec_method") is not None,
        "pipeline_parallel_size": given.get("pipeline_parallel_size") not in (None, 1),
    }
    for name, bad in refused.items():
        if bad:
            raise ValueError(f"{name} is refused by the steered engine: {_REFUSED[name]}")
    if not isinstance(rows_per_request, int) or isinstance(rows_per_request, bool) or rows_per_request < 1:
        raise ValueError(f"steering_rows_per_request must be an int >= 1, got {rows_per_request!r}")
    config = Standardized._read_config(model, given.get("revision"), given.get("trust_remote_code") or False)
    families.lookup(Standardized._model_type(config), engine=families.VLLM)
    additional = dict(given.get("additional_config") or {})
    kept = kept_values(capture_values, config.get_text_config().num_hidden_layers, additional)
    additional[CONFIG_KEY] = {"rows_per_request": rows_per_request, "code": _code_digest(), CAPTURE_SETTING: kept}
    plain = {name: value for name, value in given.items() if name not in ("worker_cls", "scheduler_cls")}
    # The checkpoint sizes the CPU build's KV cache for its context, as for every engine of ours.
    placed = engine_kwargs(str(model), **{**plain, "additional_config": additional})
    # What this platform's defaults add or replace (the executor of a CPU engine's ranks among them).
    changed = {name: value for name, value in placed.items() if name not in plain or value is not plain[name]}
    return {
        **changed,
        "worker_cls": WORKERS["cpu" if is_cpu_platform() else "gpu"],
        "scheduler_cls": f"{__name__}.{PromptCachingScheduler.__name__}",
    }


def kept_values(capture_values: Any, num_layers: int, additional_config: dict[str, Any]) -> list[str]:
    """The value names an engine built with ``capture_values`` keeps (none for ``None``), checked as `Capture`
    checks its values; ValueError for a value after the blocks the engine runs (``additional_config``)."""
    if capture_values is None:
        return []
    names = capture_specs.value_names(capture_specs.static_selectors(capture_values, "capture_values"), num_layers)
    blocks = blocks_to_run(additional_config, num_layers)
    deeper = [
        name
        for name in names
        if (name == "final_norm_output" and blocks < num_layers)
        or (name.startswith("layers.") and int(name.split(".")[1]) >= blocks)
    ]
    if deeper:
        raise ValueError(
            f"capture_values: {', '.join(deeper)} lie after the {blocks} blocks this engine runs "
            "(additional_config's first-blocks setting); keep earlier values or run every block"
        )
    return names


def steered_engine_args(
    engine_args: EngineArgs, rows_per_request: int = ROWS_PER_REQUEST, capture_values: Any = None
) -> EngineArgs:
    """A copy of vLLM ``EngineArgs`` (or ``AsyncEngineArgs``) that builds a steered engine keeping
    ``capture_values``."""
    names = (
        "worker_cls",
        "scheduler_cls",
        "speculative_config",
        "spec_method",
        "pipeline_parallel_size",
        "tensor_parallel_size",
        "distributed_executor_backend",
        "revision",
        "trust_remote_code",
        "kv_cache_memory_bytes",
        "additional_config",
    )
    given = {name: getattr(engine_args, name) for name in names if getattr(engine_args, name, None) is not None}
    settings = steering_settings(engine_args.model, given, rows_per_request, capture_values)
    return dataclasses.replace(engine_args, **settings)


def _code_digest() -> str:
    """A digest of the code the compiled graph traces through here (a change recompiles)."""
    sources = [
        Path(__file__).read_text(),
        inspect.getsource(in_engine_capture),
        inspect.getsource(containment),
        inspect.getsource(on_vllm),
        inspect.getsource(values_module),
    ]
    return hashlib.sha256("".join(sources).encode()).hexdigest()[:16]


class SteeringClient:
    """The client half the two engines share: a rendered prompt and its specs, made a steered (and capturing)
    request; the kept rows taken back from the engine."""

    vllm_config: Any

    @property
    def num_layers(self) -> int:
        """The number of standardized blocks a `Steering` can name."""
        return self.vllm_config.model_config.hf_text_config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        """The width of a steering vector."""
        return self.vllm_config.model_config.get_hidden_size()

    @property
    def capture_values(self) -> list[str]:
        """The values this engine can keep (`Capture`), as it was built to: names such as ``layers.3.layer_output``."""
        return list(self.vllm_config.additional_config[CONFIG_KEY][CAPTURE_SETTING])

    def steered_request(
        self,
        engine_input: dict[str, Any],
        params: SamplingParams,
        specs: Sequence[Steering],
        capture: Capture | None = None,
    ) -> tuple[dict[str, Any], SamplingParams, dict[str, Any] | None]:
        """A rendered prompt (vLLM's ``EngineInput``) and its sampling params, steered by ``specs`` and keeping
        what ``capture`` says; also the capture in engine form (``None`` where nothing is kept).

        Checks the specs against the model and the prompt (raising ``ValueError`` as `steer` does) and
        returns copies: the steering and the capture in ``extra_args``, the steering's cache salt in the
        prompt (after any salt the prompt had); a request keeping prompt positions vLLM would take from the
        prefix cache reads none of it. With neither, prompt and params come back as they are.
        """
        length = _prompt_length(engine_input)
        made = request_steering(
            specs,
            self.num_layers,
            self.hidden_size,
            length,
            self.vllm_config.additional_config[CONFIG_KEY]["rows_per_request"],
            self.vllm_config.model_config.dtype,
        )
        wire = None
        if capture is not None:
            if params.n != 1:
                raise ValueError(f"Capture: a capturing request makes one completion (n=1), not n={params.n}")
            wire = capture.resolved(self.num_layers, self.capture_values, length, self.vllm_config.model_config.dtype)
        if made is None and wire is None:
            return engine_input, params, None
        params = params.clone()
        extra = dict(params.extra_args or {})
        if made is not None:
            steering, salt = made
            if salt is not None:
                engine_input = dict(engine_input)
                own = engine_input.get("cache_salt")
                engine_input["cache_salt"] = f"{own}|{salt}" if own else salt
            extra[EXTRA_ARGS_KEY] = steering
        if wire is not None:
            extra[capture_specs.EXTRA_ARGS_KEY] = wire
            if not reads_prompt_from_cache(wire):
                params.skip_reading_prefix_cache = True
        params.extra_args = extra
        return engine_input, params, wire

    def _check_capture_places(self, places: dict[str, Any]) -> None:
        """Refuse, after the engine is built, values it was asked to keep but cannot (``places``: what the
        worker found, the reasons among it)."""
        if places["reasons"]:
            self.shutdown()
            reasons = "; ".join(f"{name}: {reason}" for name, reason in places["reasons"].items())
            raise ValueError(f"capture_values: this model's family cannot keep {reasons}")
        self.capture_places = places["places"]


def merged(per_worker: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The workers' answers to ``take_captured`` as one (only the first tensor-parallel rank keeps rows)."""
    return {key: found for answer in per_worker for key, found in answer.items()}


def attach_activations(output: RequestOutput, wire: dict[str, Any] | None, taken: dict[str, Any]) -> None:
    """Give ``output`` (and its completion) the rows its request kept: ``activations``, a dict from each value's
    name to a ``[kept tokens, hidden]`` tensor in position order, as many rows as tokens went through the model
    at the kept positions (the prompt and each generated token fed back in); ``None`` where it kept nothing."""
    if wire is None:
        output.activations = None
        for completion in output.outputs:
            completion.activations = None
        return
    rows = next(iter(taken.get(wire["key"], {}).values()), {})
    completion = output.outputs[0]
    fed = len(output.prompt_token_ids or []) + max(0, len(completion.token_ids) - 1)
    count = kept_count(wire, fed)
    activations = {name: unpack(rows[name])[:count] for name in wire["values"] if name in rows}
    output.activations = completion.activations = activations


def _prompt_length(engine_input: dict[str, Any]) -> int:
    if "prompt_token_ids" in engine_input:
        return len(engine_input["prompt_token_ids"])
    if "prompt_embeds" in engine_input:
        return int(engine_input["prompt_embeds"].shape[0])
    raise ValueError(
        f"Steering: cannot steer a prompt of type {engine_input.get('type')!r} without prompt_token_ids or "
        "prompt_embeds; pass text, token ids, or a prompt rendered by vLLM's renderer"
    )


class SteeredVLLM(SteeringClient, LLM):
    """vLLM's ``LLM`` whose requests may each carry `Steering` and `Capture`, both applied inside the compiled model.

    Args:
        model: A checkpoint directory or hub id whose model_type has a family in ``families/vllm/``.
        steering_rows_per_request: How many distinct sets of specs one request may apply to its tokens
            (one spec needs one; ``"prompt"`` beside ``"generated"`` two); sizes the steering table.
        capture_values: The values requests may keep (`Capture`'s selectors, e.g. ``"layers.*.layer_output"``),
            or ``None`` (the default) for none. Each is one buffer row of ``max_num_batched_tokens x
            hidden_size`` in the model's dtype, written by a static operation inside the compiled graph.
        **kwargs: Every ``vllm.LLM`` argument, as vLLM takes it: compilation stays vLLM's default and
            prefix caching stays on. On vLLM's CPU build the KV cache defaults to 64 MiB, and
            ``distributed_executor_backend="ray"`` takes ``ray_address=`` (else ``RAY_ADDRESS``, else a private
            cluster).
    """

    def __init__(
        self,
        model: Any,
        *,
        steering_rows_per_request: int = ROWS_PER_REQUEST,
        capture_values: Any = None,
        **kwargs: Any,
    ) -> None:
        settings = steering_settings(model, kwargs, steering_rows_per_request, capture_values)
        kwargs = {name: value for name, value in kwargs.items() if name not in TAKEN} | settings
        with socket_directory(self):
            start_recompiling_once(lambda: super(SteeredVLLM, self).__init__(str(model), **kwargs))
        self.vllm_config = self.llm_engine.vllm_config
        self._check_capture_places(self.collective_rpc("capture_places")[0])

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        steering: Any = None,
        *,
        capture: Any = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        priority: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``generate``, each prompt steered by its specs and keeping what its capture says; returns vLLM's
        ``RequestOutput``s in order, each capturing one with ``activations`` (`attach_activations`).

        Args:
            prompts: As for ``vllm.LLM.generate``: one or a list (text, token ids, ...).
            sampling_params: One for all prompts or one per prompt (vLLM's defaults when ``None``).
            steering: ``None``, a `Steering` or a list of them for every prompt; or a list as long as the
                prompts, one entry per prompt (``None`` for an unsteered one).
            capture: ``None``, one `Capture` for every prompt, or a list with one entry (a `Capture` or
                ``None``) per prompt. A value kept at a steered block's output is the steered stream.

        Every spec is checked against the model and its prompt before any request reaches the engine.
        """
        from vllm.renderers.inputs.preprocess import prompt_to_seq

        prompts = prompt_to_seq(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = self._params_to_seq(sampling_params, len(prompts))
        wanted = per_prompt(steering, len(prompts))
        kept = capture_specs.per_prompt(capture, len(prompts))
        rendered = self._preprocess_cmpl(prompts, tokenization_kwargs)
        requests = [self.steered_request(*request) for request in zip(rendered, params, wanted, kept)]
        self._render_and_add_requests(
            prompts=[engine_input for engine_input, _, _ in requests],
            params=[request_params for _, request_params, _ in requests],
            lora_requests=self._lora_request_to_seq(lora_request, len(prompts)),
            priorities=self._priority_to_seq(priority, len(prompts)),
        )
        wires = [wire for _, _, wire in requests]
        keys = [wire["key"] for wire in wires if wire is not None]
        try:
            outputs = self._run_engine(output_type=RequestOutput, use_tqdm=use_tqdm)
        finally:
            taken = self.take_captured(keys) if keys else {}
        for output, wire in zip(outputs, wires):
            attach_activations(output, wire, taken)
        return outputs

    def take_captured(self, keys: Sequence[str]) -> dict[str, Any]:
        """The rows the engine kept for the requests whose captures carry ``keys``, handed over and forgotten
        there: ``{key: {request id: {value name: tensor}}}`` (as `pack` made them where the worker is another
        process)."""
        from vllm.v1.engine.core_client import InprocClient
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        client = self.llm_engine.engine_core
        here = isinstance(client, InprocClient) and isinstance(client.engine_core.model_executor, UniProcExecutor)
        return merged(self.collective_rpc("take_captured", args=(list(keys), not here)))

    def capture_stats(self) -> list[dict[str, Any]]:
        """Per worker: eager runs of the capture hooks, rows kept, requests whose rows it holds."""
        return self.collective_rpc("capture_stats")

    def steering_stats(self) -> list[dict[str, Any]]:
        """Per worker: eager runs of the steering operation, its table's rows, vLLM's compile counters."""
        return self.collective_rpc("steering_stats")

    def shutdown(self) -> None:
        """Stop the engine (idempotent); another can then be built in this process. Later calls raise
        `EngineShutDown`."""
        shut_down_llm(self, type(self).__name__)
        remove_socket_directory(self)


class AsyncSteeredVLLM(SteeringClient, AsyncLLM):
    """vLLM's ``AsyncLLM`` whose ``generate`` takes a request's `Steering`: the engine behind a server.

    Built as vLLM's is: ``AsyncSteeredVLLM.from_engine_args(AsyncEngineArgs(model=..., ...))`` (every
    vLLM engine argument), or ``from_vllm_config`` with a config made from `steered_engine_args`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with socket_directory(self):
            super().__init__(*args, **kwargs)

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, *args: Any, capture_values: Any = None, **kwargs: Any
    ) -> AsyncSteeredVLLM:
        """vLLM's ``from_engine_args``, the steering worker and settings (the values requests may keep,
        ``capture_values``, among them) added to ``engine_args``. Call `check_capture_values` once it runs."""
        steered = steered_engine_args(engine_args, capture_values=capture_values)
        return super().from_engine_args(steered, *args, **kwargs)

    async def check_capture_values(self) -> None:
        """Refuse values the engine was built to keep but whose family cannot (the engine is shut down)."""
        (places, *_) = await self.collective_rpc("capture_places")
        self._check_capture_places(places)

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        steering: Any = None,
        capture: Capture | None = None,
        **kwargs: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        """vLLM's ``AsyncLLM.generate``, the prompt steered by ``steering`` (``None``, a `Steering` or a list) and
        keeping what ``capture`` says: the last output carries ``activations`` (`attach_activations`).

        The specs are checked against the model and the rendered prompt before the request is added.
        """
        refuse_after_shutdown(self, type(self).__name__)
        specs = specs_of(steering)
        wire = None
        if specs or capture is not None:
            engine_input = await self._rendered(prompt, kwargs.get("tokenization_kwargs"))
            prompt, sampling_params, wire = self.steered_request(engine_input, sampling_params, specs, capture)
        if wire is None:
            async for output in super().generate(prompt, sampling_params, request_id, **kwargs):
                yield output
            return
        taken = False
        try:
            async for output in super().generate(prompt, sampling_params, request_id, **kwargs):
                if output.finished:
                    taken = True
                    attach_activations(output, wire, await self._take_captured([wire["key"]]))
                yield output
        finally:
            if not taken:  # aborted or failed: the rows kept so far are let go
                await self._take_captured([wire["key"]])

    async def _take_captured(self, keys: Sequence[str]) -> dict[str, Any]:
        return merged(await self.collective_rpc("take_captured", args=(list(keys), True)))

    async def _rendered(self, prompt: Any, tokenization_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        if isinstance(prompt, dict) and "type" in prompt:
            return prompt
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        params = self.renderer.default_cmpl_tok_params.with_kwargs(**(tokenization_kwargs or {}))
        (engine_input,) = await self.renderer.render_cmpl_async([parse_model_prompt(self.model_config, prompt)], params)
        return engine_input

    def shutdown(self, timeout: float | None = None) -> None:
        """vLLM's shutdown, made idempotent."""
        if not getattr(self, "_shut_down", False):
            self._shut_down = True
            super().shutdown(timeout)
            remove_socket_directory(self)


__all__ = [
    "AsyncSteeredVLLM",
    "SteeredVLLM",
    "Steerer",
    "SteeringModelRunner",
    "steered_engine_args",
    "steering_settings",
]
