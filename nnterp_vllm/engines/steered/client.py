"""The client half the steered engines share (`SteeringClient`): a rendered prompt and its specs made a steered,
capturing or probing request, checked against the model and the engine's pools before it reaches the engine; and what
the engine kept for a request (its rows, its probe scores) taken back and attached to its output.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import torch
from vllm import SamplingParams
from vllm.outputs import RequestOutput

from ... import arguments
from ...specs import capture as capture_specs
from ...specs import metrics as metric_specs
from ...specs.capture import Capture, kept_count, reads_prompt_from_cache
from ...specs.metrics import metric_wire
from ...specs.patch import Patch
from ...specs.probes import EXTRA_ARGS_KEY as PROBES_KEY
from ...specs.probes import Probe, activated
from ...specs.saes import SAE
from ...specs.steering import EVERYWHERE, Clamp, Steering
from ...specs.steering_requests import EXTRA_ARGS_KEY, request_steering
from .kept_rows import CAPTURE_SETTING
from .memory import STEERING_ROWS_PER_SEQUENCE
from .steered_settings import CONFIG_KEY, PROBE_COLUMNS_SETTING, SAES_SETTING, STEERING_ENTRIES, held_saes
from .steering_pool import needs
from .tensor_wire import unpack


class SteeringClient:
    """The client half the two engines share: a rendered prompt and its specs, made a steered (and capturing)
    request; the kept rows taken back from the engine."""

    vllm_config: Any
    #: Why a value other than the blocks' ``layer_output`` (what each attention and MLP adds, the stream entering the
    #: first block) cannot be steered on this engine's model, by value, or ``None`` where it can: until the engine
    #: has said where it can act (`SteeredVLLM` asks as it starts, `AsyncSteeredVLLM` in ``check_capture_values``),
    #: specs acting there are refused, never silently left out.
    unwritable: dict[str, str | None] = dict.fromkeys(
        ("attention_output", "mlp_output", "layer_input"),
        "the engine has not yet said where it can act: call check_capture_values()",
    )

    @property
    def num_layers(self) -> int:
        """The number of standardized blocks a `Steering` can name."""
        return self.vllm_config.model_config.hf_text_config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        """The width of a steering vector."""
        return self.vllm_config.model_config.get_hidden_size()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model runs in: the checkpoint's own unless built with ``dtype=`` (`dtypes`)."""
        return self.vllm_config.model_config.dtype

    @property
    def saes(self) -> dict[str, SAE]:
        """The SAEs this engine holds (built with ``saes=[...]``), by name: a `Clamp` on a TopK SAE needs its
        engine to hold it."""
        if getattr(self, "_saes", None) is None:
            self._saes = {sae.name: sae for sae in held_saes(self.vllm_config)}
        return self._saes

    @property
    def held_saes(self) -> list[dict[str, Any]]:
        """What the client knows of the SAEs the engine holds, without loading them: each one's ``name``,
        ``path``, ``digest``, ``layer``, ``architecture``, ``d_in`` and ``d_sae``."""
        return list(self.vllm_config.additional_config[CONFIG_KEY][SAES_SETTING])

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
        probes: dict[str, Probe] | None = None,
    ) -> tuple[dict[str, Any], SamplingParams, dict[str, Any] | None]:
        """A rendered prompt (vLLM's ``EngineInput``) and its sampling params, steered by ``specs``, keeping
        what ``capture`` says and reading ``probes`` (by name); also the capture in engine form (``None`` where
        nothing is kept).

        Checks the specs and probes against the model and the prompt (raising ``ValueError`` as `steer` does) and
        returns copies: the steering, the capture and the probes in ``extra_args`` (the probes under
        ``specs.probes.EXTRA_ARGS_KEY``), the steering's cache salt in the prompt (after any salt the prompt had);
        a request keeping prompt positions vLLM would take from the prefix cache reads none of it. With none of
        them, prompt and params come back as they are.
        """
        length = _prompt_length(engine_input)
        self._check_locations(specs)
        self._check_held(specs)
        made = request_steering(
            specs,
            self.num_layers,
            self.hidden_size,
            length,
            self.vllm_config.model_config.dtype,
            self.vllm_config.additional_config[CONFIG_KEY]["directions_per_block"],
        )
        read = self.probes_wire(probes or {}, length)
        if made is not None or read is not None:
            self._check_pool(None if made is None else made[0], read, len(specs))
        wire = None
        if capture is not None:
            if params.n != 1:
                raise ValueError(f"Capture: a capturing request makes one completion (n=1), not n={params.n}")
            wire = capture.resolved(
                self.num_layers, self.capture_values, length, self.vllm_config.model_config.dtype, self.held_saes
            )
        if made is None and wire is None and read is None:
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
        if read is not None:
            extra[PROBES_KEY] = read
            forms = [{"positions": probe["positions"], "prompt_tokens": length} for probe in read["probes"]]
            if not all(reads_prompt_from_cache(form) for form in forms):
                params.skip_reading_prefix_cache = True
        params.extra_args = extra
        return engine_input, params, wire

    @property
    def max_steering_entries(self) -> int:
        """The steering pool's size: distinct contents (the specs one request applies at one block; shared by every
        block and request applying the same) the engine holds at once (`steering_pool`)."""
        return self.vllm_config.additional_config[CONFIG_KEY][STEERING_ENTRIES]

    @property
    def max_steering_rows(self) -> int:
        """Steering rows the engine holds at once: distinct sets of specs requests apply to some of their tokens
        (two per sequence the engine runs at once: ``max_num_seqs``)."""
        return STEERING_ROWS_PER_SEQUENCE * self.vllm_config.scheduler_config.max_num_seqs

    def metric_wires(self, metric: Any, count: int) -> list[dict[str, Any] | None]:
        """``metric`` as ``generate`` takes it for ``count`` prompts, each in engine form (`metric_wire`), its tokens
        checked against the vocabulary; ``ValueError`` naming what is wrong."""
        tokenizer, vocab = self.get_tokenizer(), self.vllm_config.model_config.get_vocab_size()
        return [
            None if one is None else metric_wire(one, tokenizer, vocab)
            for one in metric_specs.per_prompt(metric, count)
        ]

    @property
    def max_probe_columns(self) -> int:
        """Probe columns (a probe's class, a gate's read) the engine reads at every block, and so holds at once."""
        return self.vllm_config.additional_config[CONFIG_KEY].get(PROBE_COLUMNS_SETTING, 0)

    def probes_wire(self, probes: dict[str, Probe], prompt_length: int) -> dict[str, Any] | None:
        """A request's probes (by name) in engine form for a prompt of ``prompt_length`` tokens: a fresh key naming
        its scores, the prompt's length and each probe's (`Probe.resolved`, its positions absolute); ``None``
        without probes. ``ValueError`` naming what is wrong."""
        if not probes:
            return None
        resolved = []
        for name, probe in probes.items():
            entry = probe.resolved(name, self.num_layers, self.hidden_size)
            positions = probe.positions
            if not isinstance(positions, str):
                positions = sorted(set(arguments.positions_within(positions, prompt_length, f"Probe {name!r}")))
            resolved.append({**entry, "positions": positions})
        return {"key": uuid.uuid4().hex, "prompt_tokens": prompt_length, "probes": resolved}

    def _check_pool(self, steering: dict[str, Any] | None, probes: dict[str, Any] | None, count: int) -> None:
        """Refuse a request whose steering and probes (engine form) need more of the pool than the engine holds at
        all: it would wait forever. One that fits the pool but not its free room waits in the scheduler."""
        wanted = needs(steering, self.num_layers, probes)
        for held_count, room, what, setting in (
            (len(wanted.entries), self.max_steering_entries, "distinct block contents", "max_steering_entries=N"),
            (len(wanted.rows), self.max_steering_rows, "distinct sets of tokens", "max_num_seqs=N (two rows each)"),
            (
                len(wanted.columns),
                self.max_probe_columns,
                "probe columns (probes' classes, gates)",
                "max_probe_columns=N",
            ),
        ):
            if held_count > room:
                raise ValueError(
                    f"Steering: these {count} specs need {held_count} {what} of the engine's steering pool, which "
                    f"holds {room}; build the engine with {setting} larger, or split the request"
                )

    def _check_locations(self, specs: Sequence[Any]) -> None:
        """Refuse a spec acting at a value this engine's model cannot steer (`unwritable`): an `Ablate` at every
        residual-stream location, a `Patch` of what a block's attention or MLP adds."""
        for spec in specs:
            if spec.layers == EVERYWHERE:
                reason = next((why for why in self.unwritable.values() if why is not None), None)
                if reason is not None:
                    raise ValueError(
                        f"{spec.what}: layers={EVERYWHERE!r} (every residual-stream location) is not served on this "
                        f"model: {reason}; name the blocks whose output it acts on instead"
                    )
            value = getattr(spec, "value", "layer_output")
            if isinstance(spec, Patch) and value != "layer_output" and self.unwritable[value] is not None:
                raise ValueError(
                    f"Patch: value={value!r} is not served on this model: {self.unwritable[value]}; patch the "
                    "blocks' layer_output instead"
                )

    def _check_held(self, specs: Sequence[Any]) -> None:
        """Refuse a `Clamp` of a TopK SAE this engine does not hold: such a feature depends on all of them."""
        held_digests = {entry["digest"] for entry in self.held_saes}
        for spec in specs:
            if isinstance(spec, Clamp) and spec.sae.architecture == "topk" and spec.sae.digest not in held_digests:
                names = sorted(entry["name"] for entry in self.held_saes)
                raise ValueError(
                    f"Clamp: {spec.sae.path} is a TopK SAE, whose feature's activation depends on all of its features: "
                    f"the engine must hold it to compute them; build the engine with saes=[...] naming it (it holds "
                    f"{names or 'none'})"
                )

    def _check_capture_places(self, places: dict[str, Any]) -> None:
        """Refuse, after the engine is built, values it was asked to keep but cannot (``places``: what the
        worker found, the reasons among it)."""
        if places["reasons"]:
            self.shutdown()
            reasons = "; ".join(f"{name}: {reason}" for name, reason in places["reasons"].items())
            raise ValueError(f"capture_values: this model's family cannot keep {reasons}")
        self.capture_places = places["places"]
        self.unwritable = places["unwritable"]


def merged(per_worker: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The workers' answers to ``take_captured`` or ``take_metrics`` as one (only the first tensor-parallel rank keeps
    rows and reads metrics)."""
    return {key: found for answer in per_worker for key, found in answer.items()}


def with_extra(params: SamplingParams, key: str, value: Any) -> SamplingParams:
    """A copy of ``params`` whose ``extra_args`` also carry ``value`` under ``key``."""
    params = params.clone()
    params.extra_args = {**(params.extra_args or {}), key: value}
    return params


def probe_scores(wire: dict[str, Any], taken: dict[str, Any]) -> dict[str, torch.Tensor | None]:
    """The scores of the probes one request read (``wire``: its probes in engine form), from what `take_probes`
    took: by probe name, at its kept tokens in position order, after its activation (``[tokens]`` for a one-score
    probe, ``[tokens, classes]`` otherwise; ``None`` where the engine kept none)."""
    found = taken.get(wire["key"], {})
    probes = {}
    for probe in wire["probes"]:
        scores = activated(unpack(found[probe["name"]]), probe["activation"]) if probe["name"] in found else None
        if scores is not None and len(probe["weight"]) == 1:
            scores = scores[:, 0]
        probes[probe["name"]] = scores
    return probes


def attach_probes(output: RequestOutput, wire: dict[str, Any] | None, taken: dict[str, Any]) -> None:
    """Give ``output`` (and its completion) the probe scores its request kept: ``probes`` (`probe_scores`);
    ``None`` where it asked for none."""
    probes = None if wire is None else probe_scores(wire, taken)
    output.probes = probes
    for completion in output.outputs:
        completion.probes = probes


def attach_activations(output: RequestOutput, wire: dict[str, Any] | None, taken: dict[str, Any]) -> None:
    """Give ``output`` (and its completion) the rows its request kept: ``activations``, a dict from each value's
    name to a ``[kept tokens, hidden]`` tensor in position order (``[kept tokens, k]`` for SAE features), as many
    rows as tokens went through the model at the kept positions (the prompt and each generated token fed back in);
    ``None`` where it kept nothing."""
    if wire is None:
        output.activations = None
        for completion in output.outputs:
            completion.activations = None
        return
    rows = next(iter(taken.get(wire["key"], {}).values()), {})
    completion = output.outputs[0]
    fed = len(output.prompt_token_ids or []) + max(0, len(completion.token_ids) - 1)
    count = kept_count(wire, fed)
    activations = {name: unpack(rows[name])[:count] for name in wire.get("returned", wire["values"]) if name in rows}
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


__all__ = ["SteeringClient", "attach_activations", "attach_probes", "merged", "probe_scores", "with_extra"]
