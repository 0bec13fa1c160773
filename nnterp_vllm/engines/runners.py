"""The steered engine's worker and model runner: vLLM's own for the platform, with the steering and capture
operations installed as the model loads and their buffers filled before each step.

The worker is vLLM's ``CPUWorker`` on the CPU build and its GPU ``Worker`` elsewhere; its model runner is vLLM's V1
runner of that platform with `SteeringModelRunner` mixed in front. Nothing of the CPU build is imported off the
CPU platform: its worker module replaces parts of ``torch.cuda`` process-wide as it is imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import containment
from .capture import CAPTURE_SETTING, Capturer, keeps_rows
from .logit_metrics import MetricReader
from .memory import Ledger, check_room, engine_buffers
from .probe_reads import ProbeReader
from .sae_encoding import place_saes
from .steered_settings import CONFIG_KEY, WORKER_CLASSES, held_saes, sizes_of
from .steering_table import Steerer
from .vllm_platform import built_on_access, is_cpu_platform, publish, refuse_other_runner, run_first_blocks


class SteeringModelRunner:
    """Mixed in front of vLLM's model runner: installs the steering and capture operations (and the metrics read from
    the logits) at load, fills the steering table and lays out the kept rows before each step, sends the kept rows
    out after it."""

    _steerer: Steerer
    _capturer: Capturer
    #: Set by the worker on an accelerator: what its memory profile will grant this engine.
    memory_budget: MemoryBudget | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Load as vLLM does, then keep its KV cache finite (`containment`) and add the operations before anything
        compiles the model (steering first, so a value kept at a steered block's output is the steered stream).

        Everything reads the model vLLM loaded (``get_model()``), never the CUDA-graph wrapper vLLM puts around it
        on GPUs. The operations' buffers are the memory model's (`memory.engine_buffers`), allocated here, before
        vLLM profiles memory, so its profile counts them; on an accelerator they are first checked against what
        the engine may still take."""
        super().load_model(*args, **kwargs)
        if self.vllm_config.parallel_config.use_ubatching:
            raise ValueError(
                "micro-batching (enable_dbo or ubatch_size > 1) is refused by the steered engine: its steering rows "
                "and kept rows are laid out over a whole step"
            )
        model = self.get_model()
        containment.keep_kv_cache_finite(model)
        run_first_blocks(model, self.vllm_config)
        names = self.vllm_config.additional_config[CONFIG_KEY].get(CAPTURE_SETTING, [])
        buffers = engine_buffers(sizes_of(self.vllm_config, self.device.type != "cpu", keeps_rows()))
        if self.memory_budget is not None:
            check_room(buffers, self.memory_budget.left(self.device))
        self._ledger = Ledger(buffers, self.device)
        placed, encoding = place_saes(held_saes(self.vllm_config), self._ledger)
        topk = {layer: sae for layer, sae in placed.items() if sae.architecture == "topk"}
        self._steerer = Steerer(model, self.vllm_config, self._ledger, topk, encoding)
        self._capturer = Capturer(model, self.vllm_config, names, self._ledger, placed, encoding)
        self._metrics = MetricReader(model)
        self._probes = ProbeReader(self._steerer.buffers.probe_scores)

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        prepared = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        batch = self.input_batch
        self._steerer.fill(batch.req_ids, num_scheduled_tokens, batch.num_computed_tokens_cpu, self.requests)
        self._capturer.plan(batch.req_ids, num_scheduled_tokens, batch.num_computed_tokens_cpu, self.requests)
        self._metrics.plan(batch.req_ids, num_scheduled_tokens, batch.num_computed_tokens_cpu, self.requests)
        self._probes.plan(batch.req_ids, num_scheduled_tokens, batch.num_computed_tokens_cpu, self.requests)
        return prepared

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's forward, bypassing the compiled model (and CUDA graphs) for a step that must run eagerly: one in
        which a token clamps a TopK SAE's feature (`steering_table`)."""
        if self._steerer.eager:
            from vllm.config import CUDAGraphMode
            from vllm.forward_context import get_forward_context

            context = get_forward_context()
            context.skip_compiled = True
            context.cudagraph_runtime_mode = CUDAGraphMode.NONE
        return super()._model_forward(*args, **kwargs)

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        output = super().execute_model(*args, **kwargs)
        self._capturer.gather()
        self._probes.gather()
        return output

    def _on_request_state_removed(self, req_id: str, req_state: Any) -> None:
        super()._on_request_state_removed(req_id, req_state)
        self._steerer.forget(req_id)
        self._capturer.forget(req_id)

    def shutdown(self) -> None:
        """Finish writing the kept rows sent (`Capturer.close`), then shut down as vLLM does."""
        try:
            capturer = getattr(self, "_capturer", None)  # none where loading failed
            if capturer is not None:
                capturer.close()
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
        refuse_other_runner(self.model_runner, Runner, "the steered engine")
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
            "allocated_buffers": allocated_buffers,
            "take_metrics": take_metrics,
            "take_probes": take_probes,
        },
    )
    publish(globals(), runner_class, worker_class)


#: The worker classes are built on first access, in whichever process vLLM imports them.
__getattr__ = built_on_access(globals(), WORKER_CLASSES, _define_worker_classes)
