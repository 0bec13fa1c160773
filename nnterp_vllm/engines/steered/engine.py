"""`SteeredVLLM` and `AsyncSteeredVLLM`: vLLM's own ``LLM`` and ``AsyncLLM`` with steering compiled into the model.

Each request may carry `Steering` specs and a `Capture`. The engine is vLLM's, built with the arguments
`steered_settings` adds: its worker and model runner (`runners`) install one static operation at every standardized
block (`steering_table`) and one per kept value (`kept_rows`) as the model loads, and fill their buffers before each
step, so the compiled graph (and CUDA graphs on GPUs) serve any mix of requests. A steered request's prompt carries a
``cache_salt`` digesting its steering, so prefix-cache blocks are shared only between requests steered alike
(unsteered ones share with each other, as on plain vLLM; `scheduling` keeps steered generated tokens out of the
cache). The compile cache is keyed apart from plain vLLM's through ``additional_config``. Both engines make their
requests, and take back what the engine kept for them, through the client half they share (`client.SteeringClient`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.outputs import RequestOutput
from vllm.v1.engine.async_llm import AsyncLLM

from ...checkpoints import read_config_with
from ...remote import TRACE_KEY
from ...specs import capture as capture_specs
from ...specs import probes as probe_specs
from ...specs.capture import Capture
from ...specs.metrics import EXTRA_ARGS_KEY as METRIC_KEY
from ...specs.probes import EXTRA_ARGS_KEY as PROBES_KEY
from ...specs.probes import Probe
from ...specs.steering_requests import DIRECTIONS_PER_BLOCK, per_prompt, specs_of
from ..closed import refuse_after_shutdown, shut_down_llm
from ..compile_cache import start_recompiling_once
from ..engine_defaults import TAKEN
from ..lifecycle import remove_socket_directory, socket_directory
from .client import SteeringClient, attach_activations, attach_probes, merged, with_extra
from .memory import PROBE_COLUMNS
from .shared_rows import INTO
from .steered_settings import held, steered_engine_args, steering_settings


def isolated(prompt: Any) -> Any:
    """``prompt`` (text, or any of vLLM's prompt dicts) with a prefix-cache salt of its own, after any salt it had: a
    trace request's KV, computed under its code, is read by no other request. (nnsight's client already has it read
    none: ``skip_reading_prefix_cache``.)"""
    salt = uuid.uuid4().hex
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": salt}
    own = prompt.get("cache_salt")
    return {**prompt, "cache_salt": f"{own}|{salt}" if own else salt}


class SteeredVLLM(SteeringClient, LLM):
    """vLLM's ``LLM`` whose requests may each carry `Steering` and `Capture`, both applied inside the compiled model.

    Args:
        model: A checkpoint directory or hub id whose model_type has a family in ``families/vllm/``.
        steering_directions_per_block: How many caps, ablations and SAE feature clamps one token may have at one
            block (`specs.steering_requests.DIRECTIONS_PER_BLOCK` by default); each is a direction slot of every
            entry of the steering pool, applied in turn at every block of every step, steered or not.
        max_steering_entries: The steering pool's size: how many distinct contents (the specs one request applies
            at one block, shared by every block and request applying the same) the engine holds at once; by default
            as many as 32 MiB holds, within 64..512 (`memory.default_steering_entries`). A request whose content
            does not fit the room left waits in the scheduler until it does, as for KV blocks. 0 (with
            ``max_probe_columns=0``) builds an engine that steers nothing and runs no steering operation: a
            capture-only engine, as the harvest builds.
        max_probe_columns: Probe columns (each class of a `specs.probes.Probe` a request reads, and each gate's
            read) the engine reads at every block as one small product, and so holds at once (16 by default; 0 reads
            none: no probes, no gates).
        steering_values: The values the steering operation acts at, among `specs.steering.STEERING_VALUES` (all
            of them by default): ``"layer_output"`` (always: every `Steering`, `Cap` and `Clamp` acts there), and
            ``"attention_output"``, ``"mlp_output"``, ``"layer_input"`` (a `Patch` of a sublayer, an `Ablate` at
            every location). The operation runs at every place it acts at on every step, steered or not: an engine
            built with ``["layer_output"]`` runs it once per block instead of about three times, and refuses the
            specs that need the others.
        capture_values: The values requests may keep (`Capture`'s selectors, e.g. ``"layers.*.layer_output"``),
            or ``None`` (the default) for none. Each is one buffer row of ``max_num_batched_tokens x
            hidden_size`` in the model's dtype, written by a static operation inside the compiled graph.
        saes: The SAEs the engine holds (`SAE`s or SAELens directories), by name in ``saes``: a `Clamp` of a TopK
            SAE's feature needs its engine to hold that SAE (the steering operation computes its encoder at that
            block); one per block.
        **kwargs: Every ``vllm.LLM`` argument, as vLLM takes it: compilation stays vLLM's default and
            prefix caching stays on. The model runs in the checkpoint's own dtype, as on transformers (`dtypes`),
            unless ``dtype=`` (or ``torch_dtype=``) names another; vLLM's ``"auto"`` would run a float32
            checkpoint in bfloat16. On vLLM's CPU build the KV cache defaults to 64 MiB, and
            ``distributed_executor_backend="ray"`` takes ``ray_address=`` (else ``RAY_ADDRESS``, else a private
            cluster).
    """

    def __init__(
        self,
        model: Any,
        *,
        steering_directions_per_block: int = DIRECTIONS_PER_BLOCK,
        max_steering_entries: int | None = None,
        max_probe_columns: int = PROBE_COLUMNS,
        steering_values: Sequence[str] | None = None,
        capture_values: Any = None,
        saes: Any = None,
        **kwargs: Any,
    ) -> None:
        config = read_config_with(model, kwargs)
        loaded = held(config, saes)
        settings = steering_settings(
            model,
            kwargs,
            capture_values,
            loaded,
            steering_directions_per_block,
            max_steering_entries,
            max_probe_columns,
            steering_values,
            config,
        )
        kwargs = {name: value for name, value in kwargs.items() if name not in TAKEN} | settings
        with socket_directory(self):
            start_recompiling_once(lambda: super(SteeredVLLM, self).__init__(str(model), **kwargs))
        self.vllm_config = self.llm_engine.vllm_config
        self._saes = {sae.name: sae for sae in loaded}
        self._check_capture_places(self.collective_rpc("capture_places")[0])

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        steering: Any = None,
        *,
        capture: Any = None,
        metric: Any = None,
        probes: Any = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        priority: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``generate``, each prompt steered by its specs and keeping what its capture says; returns vLLM's
        ``RequestOutput``s in order, each capturing one with ``activations`` (`attach_activations`), each measuring
        one with ``metric`` (a float).

        Args:
            prompts: As for ``vllm.LLM.generate``: one or a list (text, token ids, ...).
            sampling_params: One for all prompts or one per prompt (vLLM's defaults when ``None``).
            steering: ``None``, a `Steering` or a list of them for every prompt; or a list as long as the
                prompts, one entry per prompt (``None`` for an unsteered one).
            capture: ``None``, one `Capture` for every prompt, or a list with one entry (a `Capture` or
                ``None``) per prompt. A value kept at a steered block's output is the steered stream.
            metric: ``None``, one metric (`specs.metrics`: ``LogitDiff``, ``Logprob``) for every prompt, or a
                list with one entry per prompt: read in the engine's worker from the logits of the prompt's last
                position, the output's ``metric`` (``None`` where none was asked).
            probes: ``None``, one dict from names to `specs.probes.Probe` for every prompt, or a list with one
                entry per prompt: each probe read in the engine at its block, per token at its positions; the
                output's ``probes`` (``{name: [kept tokens]`` or ``[kept tokens, classes]}``, after each probe's
                activation; ``None`` where none was asked).

        Every spec is checked against the model and its prompt before any request reaches the engine.
        """
        from vllm.renderers.inputs.preprocess import prompt_to_seq

        measured = self.metric_wires(metric, len(prompt_to_seq(prompts)))
        submitted = self.submit(
            prompts,
            sampling_params,
            steering,
            capture=capture,
            metrics=measured,
            probes=probes,
            lora_request=lora_request,
            priority=priority,
            tokenization_kwargs=tokenization_kwargs,
        )
        wires = [wire for _, wire, _ in submitted]
        read = [probe_wire for *_, probe_wire in submitted]
        keys = [wire["key"] for wire in wires if wire is not None]
        metric_keys = [wire["key"] for wire in measured if wire is not None]
        try:
            outputs = self._run_engine(output_type=RequestOutput, use_tqdm=use_tqdm)
        finally:
            taken = self.take_captured(keys) if keys else {}
            values = self.take_metrics(metric_keys) if metric_keys else {}
            scores = self.take_probes([wire["key"] for wire in read if wire is not None]) if any(read) else {}
        for output, wire, measure, probe_wire in zip(outputs, wires, measured, read):
            attach_activations(output, wire, taken)
            output.metric = None if measure is None else values.get(measure["key"])
            attach_probes(output, probe_wire, scores)
        return outputs

    def submit(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        steering: Any = None,
        *,
        capture: Any = None,
        lora_request: Any = None,
        priority: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        destinations: Sequence[dict[str, Any] | None] | None = None,
        metrics: Sequence[dict[str, Any] | None] | None = None,
        probes: Any = None,
    ) -> list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]]:
        """Check and add requests as `generate` does, without running the engine: each prompt's request id (as its
        ``RequestOutput`` carries it), its capture in engine form (``None`` where it keeps nothing) and its probes
        in engine form (``None`` where it reads none), in order.
        ``llm_engine.step()`` runs them; `take_captured` takes their rows. ``destinations`` (one per prompt,
        `shared_rows.SharedRows.destination`) has the engine keep a capturing request's rows in shared memory the
        caller made; ``metrics`` (one per prompt, `metric_wires`) has it read a metric of each, which
        `take_metrics` takes; ``probes`` as `generate` takes them (`take_probes` takes their scores)."""
        from vllm.renderers.inputs.preprocess import prompt_to_seq

        prompts = prompt_to_seq(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = self._params_to_seq(sampling_params, len(prompts))
        wanted = per_prompt(steering, len(prompts))
        kept = capture_specs.per_prompt(capture, len(prompts))
        rendered = self._preprocess_cmpl(prompts, tokenization_kwargs)
        read = probe_specs.per_prompt(probes, len(prompts))
        requests = [self.steered_request(*request) for request in zip(rendered, params, wanted, kept, read)]
        for index, measure in enumerate(metrics or ()):
            if measure is not None:
                engine_input, request_params, wire = requests[index]
                requests[index] = (engine_input, with_extra(request_params, METRIC_KEY, measure), wire)
        wires = [wire for _, _, wire in requests]
        read = [(request_params.extra_args or {}).get(PROBES_KEY) for _, request_params, _ in requests]
        for wire, destination in zip(wires, destinations or ()):
            if wire is not None and destination is not None:
                wire[INTO] = destination
        ids = self._render_and_add_requests(
            prompts=[engine_input for engine_input, _, _ in requests],
            params=[request_params for _, request_params, _ in requests],
            lora_requests=self._lora_request_to_seq(lora_request, len(prompts)),
            priorities=self._priority_to_seq(priority, len(prompts)),
        )
        # vLLM's engine adds a random suffix to the id it numbered a request with; its outputs carry the number.
        return [(request_id.split("-", 1)[0], wire, probes) for request_id, wire, probes in zip(ids, wires, read)]

    def take_captured(self, keys: Sequence[str]) -> dict[str, Any]:
        """The rows the engine kept for the requests whose captures carry ``keys``, handed over and forgotten
        there: ``{key: {request id: {value name: tensor}}}`` (as `pack` made them where the worker is another
        process)."""
        return merged(self.collective_rpc("take_captured", args=(list(keys), not self._in_process())))

    def take_probes(self, keys: Sequence[str]) -> dict[str, Any]:
        """The probe scores the engine kept for the requests carrying probe ``keys``, handed over and forgotten
        there: ``{key: {probe name: [tokens, classes]}}`` (as `pack` made them where the worker is another
        process)."""
        return merged(self.collective_rpc("take_probes", args=(list(keys), not self._in_process())))

    def _in_process(self) -> bool:
        """Whether the engine's worker runs in this process (what it hands back needs no packing)."""
        from vllm.v1.engine.core_client import InprocClient
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        client = self.llm_engine.engine_core
        return isinstance(client, InprocClient) and isinstance(client.engine_core.model_executor, UniProcExecutor)

    def take_metrics(self, keys: Sequence[str]) -> dict[str, float]:
        """The metrics the engine read for the requests carrying metric ``keys`` (`metric_wires`), handed over and
        forgotten there."""
        return merged(self.collective_rpc("take_metrics", args=(list(keys),)))

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
        cls, engine_args: EngineArgs, *args: Any, capture_values: Any = None, saes: Any = None, **kwargs: Any
    ) -> AsyncSteeredVLLM:
        """vLLM's ``from_engine_args``, the steering worker and settings (the values requests may keep,
        ``capture_values``, and the SAEs it holds, ``saes``, among them) added to ``engine_args``. Call
        `check_capture_values` once it runs."""
        steered = steered_engine_args(engine_args, capture_values=capture_values, saes=saes)
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
        metric: Any = None,
        probes: dict[str, Probe] | None = None,
        **kwargs: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        """vLLM's ``AsyncLLM.generate``, the prompt steered by ``steering`` (``None``, a `Steering` or a list),
        keeping what ``capture`` says, reading ``probes`` (by name) per token and ``metric`` (`specs.metrics`)
        from its prompt's last-position logits: the last output carries ``activations`` (`attach_activations`),
        ``probes`` (`attach_probes`) and ``metric``.

        The specs are checked against the model and the rendered prompt before the request is added. A request
        carrying nnsight's trace code (as nnsight's client makes it: ``extra_args["nnsight_mediator"]``) runs it,
        in an eager step, isolated from the prefix cache (`isolated`).
        """
        refuse_after_shutdown(self, type(self).__name__)
        if TRACE_KEY in (sampling_params.extra_args or {}):
            prompt = isolated(prompt)
        specs = specs_of(steering)
        wire = None
        (measure,) = self.metric_wires(metric, 1)
        read = None
        if specs or capture is not None or probes:
            engine_input = await self._rendered(prompt, kwargs.get("tokenization_kwargs"))
            prompt, sampling_params, wire = self.steered_request(
                engine_input, sampling_params, specs, capture, probe_specs.probes_of(probes)
            )
            read = (sampling_params.extra_args or {}).get(PROBES_KEY)
        if measure is not None:
            sampling_params = with_extra(sampling_params, METRIC_KEY, measure)
        if wire is None and measure is None and read is None:
            async for output in super().generate(prompt, sampling_params, request_id, **kwargs):
                yield output
            return
        taken = False
        try:
            async for output in super().generate(prompt, sampling_params, request_id, **kwargs):
                if output.finished:
                    taken = True
                    if wire is not None:
                        attach_activations(output, wire, await self._take_captured([wire["key"]]))
                    if measure is not None:
                        output.metric = (await self._take_metrics([measure["key"]])).get(measure["key"])
                    if read is not None:
                        attach_probes(output, read, await self._take_probes([read["key"]]))
                yield output
        finally:
            if not taken:  # aborted or failed: what was kept so far is let go
                if wire is not None:
                    await self._take_captured([wire["key"]])
                if measure is not None:
                    await self._take_metrics([measure["key"]])
                if read is not None:
                    await self._take_probes([read["key"]])

    async def _take_probes(self, keys: Sequence[str]) -> dict[str, Any]:
        return merged(await self.collective_rpc("take_probes", args=(list(keys), True)))

    async def _take_metrics(self, keys: Sequence[str]) -> dict[str, float]:
        return merged(await self.collective_rpc("take_metrics", args=(list(keys),)))

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


__all__ = ["AsyncSteeredVLLM", "SteeredVLLM"]
