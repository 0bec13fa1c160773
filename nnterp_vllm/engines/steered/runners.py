"""The engines' one worker and model runner: vLLM's own for the platform, running each step through the compiled
model (and CUDA graphs on GPUs) unless a request in it carries an nnsight trace, and steering and capturing in both
kinds of step.

The worker is vLLM's ``CPUWorker`` on the CPU build and its GPU ``Worker`` elsewhere; its model runner is vLLM's V1
runner of that platform with nnsight's runner (which interleaves a trace's code with the forward) and
`EngineModelRunner` mixed in front. Every engine of the library runs it: the steered engine (`SteeredVLLM`,
`AsyncSteeredVLLM`, ``nnterp-vllm serve``, the vLLM harvest), whose settings in ``additional_config`` install the
steering and capture operations as the model loads, and the notebook engine (`StandardizedVLLM`), which has none.
A step in which some request's trace code runs (its own block or an edit left on the engine) runs eagerly, with
nnsight's interleaving: vLLM pads no CUDA graph for it (``force_eager``) and its forward bypasses the compiled model
(the forward context's ``skip_compiled``); so does a step in which a token clamps a TopK SAE's feature
(`steering_table`). Every other step runs compiled, where nnsight's handoffs are inert. Nothing of the CPU build
is imported off the CPU platform: its worker module replaces parts of ``torch.cuda`` process-wide as it is imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .. import containment
from ..first_blocks import run_first_blocks
from ..saving import SAVED_BYTES_KEY, SavedBytes, mark_in_worker
from ..vllm_platform import is_cpu_platform
from ..worker_classes import WORKER_CLASSES, built_on_access, publish, refuse_other_runner
from .kept_rows import CAPTURE_SETTING, Capturer, keeps_rows
from .logit_metrics import MetricReader
from .memory import Ledger, check_room, engine_buffers
from .probe_reads import ProbeReader
from .sae_encoding import place_saes
from .steered_settings import (
    CONFIG_KEY,
    STEERING_VALUES_SETTING,
    held_saes,
    sizes_of,
)
from .steerer import Steerer

#: The RPC methods nnsight's GPU worker adds (``collective_rpc`` targets of nnsight's client side).
NNSIGHT_RPC_METHODS = ("collect_nnsight", "nnsight_request_count", "nnsight_register", "nnsight_clear_registered")


class EngineModelRunner:
    """Mixed between nnsight's model runner and vLLM's: chooses each step's kind (compiled, or eager where trace code
    or a TopK clamp runs in it); on a steered engine also installs the steering and capture operations (and the
    metrics and probes read from the logits and the stream) at load, fills the steering table and lays out the kept
    rows before each step, sends the kept rows out after it."""

    _steerer: Steerer | None = None
    _capturer: Capturer | None = None
    _ledger: Ledger | None = None
    _metrics: MetricReader | None = None
    _probes: ProbeReader | None = None
    #: Set by the worker on an accelerator: what its memory profile will grant this engine.
    memory_budget: MemoryBudget | None = None
    #: Whether the step being prepared runs eagerly (`_prepare_inputs` decides, once its requests are known), and
    #: its kind as `step_kinds` counts it.
    _eager_step = False
    _step_kind = "compiled"

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Load as vLLM does, keep its KV cache finite (`containment`) and, on a steered engine, add the steering
        and capture operations before anything compiles the model (steering first, so a value kept at a steered
        block's output is the steered stream); nnsight's runner then builds its module tree over all of it, so a
        trace's handoff at a module comes before what this library added inside it (a trace's write to an
        attention layer's keys is cached finite too).

        Everything reads the model vLLM loaded (``get_model()``), never the CUDA-graph wrapper vLLM puts around it
        on GPUs. The operations' buffers are the memory model's (`memory.engine_buffers`), allocated here, before
        vLLM profiles memory, so its profile counts them; on an accelerator they are first checked against what
        the engine may still take."""
        super().load_model(*args, **kwargs)
        model = self.get_model()
        run_first_blocks(model, self.vllm_config)
        containment.keep_kv_cache_finite(model)
        #: Steps run so far, by kind: through the model as vLLM built it ("compiled", unless built eagerly), eagerly
        #: (trace code or a TopK clamp in them), and eagerly for trace code with requests that run none in them too.
        self.step_kinds = {"compiled": 0, "eager": 0, "eager beside others": 0}
        if CONFIG_KEY in (self.vllm_config.additional_config or {}):
            self._install_steering(model)

    def _install_steering(self, model: torch.nn.Module) -> None:
        if self.vllm_config.parallel_config.use_ubatching:
            raise ValueError(
                "micro-batching (enable_dbo or ubatch_size > 1) is refused by the steered engine: its steering rows "
                "and kept rows are laid out over a whole step"
            )
        names = self.vllm_config.additional_config[CONFIG_KEY].get(CAPTURE_SETTING, [])
        buffers = engine_buffers(sizes_of(self.vllm_config, self.device.type != "cpu", keeps_rows()))
        if self.memory_budget is not None:
            check_room(buffers, self.memory_budget.left(self.device))
        self._ledger = Ledger(buffers, self.device)
        placed, encoding = place_saes(held_saes(self.vllm_config), self._ledger)
        topk = {layer: sae for layer, sae in placed.items() if sae.architecture == "topk"}
        steering_values = self.vllm_config.additional_config[CONFIG_KEY][STEERING_VALUES_SETTING]
        self._steerer = Steerer(model, self.vllm_config, self._ledger, topk, encoding, steering_values)
        self._capturer = Capturer(model, self.vllm_config, names, self._ledger, placed, encoding)
        self._metrics = MetricReader(model)
        self._probes = ProbeReader(self._steerer.buffers.probe_scores)

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        prepared = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        batch = self.input_batch
        topk = False
        if self._steerer is not None:
            step = (batch.req_ids, num_scheduled_tokens, batch.num_computed_tokens_cpu, self.requests)
            for planned in (self._probes.plan, self._capturer.plan, self._metrics.plan):
                planned(*step)
            self._steerer.fill(*step, probing=bool(self._probes.step))
            topk = self._steerer.eager
        # nnsight's runner has scoped this step's trace code (`_update_states`): ``busy`` when some runs in it.
        traced = self.nnsight_model.interleaver.busy
        self._eager_step = topk or traced
        tracing = self.nnsight_requests.requests
        if traced and any(request_id not in tracing for request_id in scheduler_output.num_scheduled_tokens):
            self._step_kind = "eager beside others"
        else:
            self._step_kind = "eager" if self._eager_step else "compiled"
        return prepared

    def _determine_batch_execution_and_padding(self, *args: Any, force_eager: bool = False, **kwargs: Any) -> Any:
        """vLLM's choice of CUDA graph (and its padding) for the step; none for an eager step, whose tokens then
        are exactly the scheduled ones (nnsight's interleaving locates each request's tokens among them)."""
        return super()._determine_batch_execution_and_padding(
            *args, force_eager=force_eager or self._eager_step, **kwargs
        )

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's forward, bypassing the compiled model (and CUDA graphs) for a step that runs eagerly."""
        if self._eager_step:
            from vllm.config import CUDAGraphMode
            from vllm.forward_context import get_forward_context

            context = get_forward_context()
            context.skip_compiled = True
            context.cudagraph_runtime_mode = CUDAGraphMode.NONE
        return super()._model_forward(*args, **kwargs)

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        try:
            output = super().execute_model(*args, **kwargs)
        finally:
            self.step_kinds[self._step_kind] += 1
            self._eager_step, self._step_kind = False, "compiled"
        if self._capturer is not None:
            self._capturer.gather()
            self._probes.gather()
        return output

    def _on_request_state_removed(self, req_id: str, req_state: Any) -> None:
        super()._on_request_state_removed(req_id, req_state)
        if self._steerer is not None:
            self._steerer.forget(req_id)
            self._capturer.forget(req_id)

    def shutdown(self) -> None:
        """Finish writing the kept rows sent (`Capturer.close`), then shut down as vLLM does."""
        try:
            if self._capturer is not None:  # none where loading failed, or on a notebook engine
                self._capturer.close()
        finally:
            super().shutdown()


@dataclasses.dataclass
class MemoryBudget:
    """What vLLM's GPU worker measured as it started: the device's free memory then, the share of the device the
    engine may take (``gpu_memory_utilization``), and the KV cache size the caller fixed, if any."""

    free_at_start: int
    requested: int
    kv_cache_bytes: int | None

    def left(self, device: torch.device) -> int:
        """Bytes of ``device`` the engine may still take now (its weights loaded), by vLLM's own accounting."""
        free, _ = torch.get_device_module(device).mem_get_info(device)
        if self.kv_cache_bytes:
            return free - self.kv_cache_bytes
        return min(free, self.requested - (self.free_at_start - free))


def _define_worker_classes() -> None:
    """Build the worker and runner of this platform into this module."""
    from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner, Requests
    from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker

    if is_cpu_platform():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner as Runner
        from vllm.v1.worker.cpu_worker import CPUWorker as Worker

        names = ("EngineCPUModelRunner", "EngineCPUWorker")
    else:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as Runner
        from vllm.v1.worker.gpu_worker import Worker

        names = ("EngineGPUModelRunner", "EngineGPUWorker")

    class StandardizedRequests(Requests):
        """nnsight's per-request bookkeeping; what a block saved also counts its containers of saved values, and
        what a bounded trace saves is counted as it saves it (`saving.SavedBytes`)."""

        saved_bytes: SavedBytes | None = None

        def add(self, new_requests: list[Any], persistent_objects: dict) -> None:
            """nnsight's, keeping only the requests that run trace code (or carry an error to hand back): a request
            that runs none (an OpenAI route's, a steered one's) leaves nothing to track, collect or copy."""
            super().add(new_requests, persistent_objects)
            for data in new_requests:
                request = self.requests.get(data.req_id)
                if request is None:
                    continue
                if request.mediator is None and not request.copies and request.error is None:
                    del self.requests[data.req_id]
                    continue
                bound = (getattr(data.sampling_params, "extra_args", None) or {}).get(SAVED_BYTES_KEY)
                if bound is not None and request.mediator is not None:
                    if self.saved_bytes is None:
                        self.saved_bytes = SavedBytes()
                    self.saved_bytes.track(request.mediator, bound)

        def record(self, mediator: Any) -> None:
            mark_in_worker(mediator)
            super().record(mediator)
            if self.saved_bytes is not None:
                self.saved_bytes.count(mediator)

    class runner_class(NNsightGPUModelRunner, EngineModelRunner, Runner):  # noqa: N801 - named below
        __doc__ = f"vLLM's {Runner.__name__} with nnsight's interleaving, steering and capture."

        def load_model(self, *args: Any, **kwargs: Any) -> None:
            super().load_model(*args, **kwargs)
            self.nnsight_requests.__class__ = StandardizedRequests

    runner_class.__name__ = names[0]

    def init_device(self: Any) -> None:
        Worker.init_device(self)
        refuse_other_runner(self.model_runner, Runner, "this library")
        self.model_runner.__class__ = runner_class
        snapshot = getattr(self, "init_snapshot", None)
        if snapshot is not None and self.device.type != "cpu":
            self.model_runner.memory_budget = MemoryBudget(
                snapshot.free_memory, self.requested_memory, self.cache_config.kv_cache_memory_bytes
            )

    def steering_stats(self: Any) -> dict[str, Any]:
        return self.model_runner._steerer.stats()

    def capture_stats(self: Any) -> dict[str, Any]:
        return self.model_runner._capturer.stats()

    def capture_places(self: Any) -> dict[str, Any]:
        capturer = self.model_runner._capturer
        unwritable = self.model_runner._steerer.unwritable
        return {"reasons": capturer.reasons, "places": capturer.places, "unwritable": unwritable}

    def take_captured(self: Any, keys: Sequence[str], packed: bool) -> dict[str, Any]:
        return self.model_runner._capturer.take(keys, packed)

    def allocated_buffers(self: Any) -> dict[str, Any]:
        return self.model_runner._ledger.held()

    def take_metrics(self: Any, keys: Sequence[str]) -> dict[str, float]:
        return self.model_runner._metrics.take(keys)

    def take_probes(self: Any, keys: Sequence[str], packed: bool) -> dict[str, Any]:
        return self.model_runner._probes.take(keys, packed)

    def step_kinds(self: Any) -> dict[str, int]:
        return dict(self.model_runner.step_kinds)

    methods = {
        "__doc__": f"vLLM's {Worker.__name__} whose runner traces, steers and captures.",
        "init_device": init_device,
        "steering_stats": steering_stats,
        "capture_stats": capture_stats,
        "capture_places": capture_places,
        "take_captured": take_captured,
        "allocated_buffers": allocated_buffers,
        "take_metrics": take_metrics,
        "take_probes": take_probes,
        "step_kinds": step_kinds,
    }
    # nnsight's RPC methods, as its GPU worker has them: they only forward to the runner.
    methods.update({name: getattr(NNsightGPUWorker, name) for name in NNSIGHT_RPC_METHODS})
    worker_class = type(names[1], (Worker,), methods)
    publish(globals(), runner_class, worker_class)


#: The worker classes are built on first access, in whichever process vLLM imports them.
__getattr__ = built_on_access(globals(), WORKER_CLASSES, _define_worker_classes)
