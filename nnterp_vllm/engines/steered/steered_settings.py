"""The engine arguments of a steered engine: its worker, scheduler and settings, checked before anything loads."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from vllm.engine.arg_utils import EngineArgs

from ... import families
from ...checkpoints import read_config_with
from ...components import values as values_module
from ...components import vllm as on_vllm
from ...components.names import SAE_FEATURES
from ...specs import capture as capture_specs
from ...specs import steering as specs
from ...specs.saes import SAE, sae_list
from ...specs.steering_requests import DIRECTIONS_PER_BLOCK
from .. import containment
from ..engine_defaults import engine_kwargs
from ..first_blocks import blocks_to_run
from ..vllm_environment import choose_model_runner, no_saved_graphs
from ..worker_classes import worker_class
from . import kept_rows as in_engine_capture
from . import memory
from .kept_rows import CAPTURE_SETTING
from .memory import PROBE_COLUMNS, EngineSizes, default_steering_entries

#: ``additional_config`` key of the engine's steering settings (it also keys vLLM's compile cache).
CONFIG_KEY = "nnterp_vllm_steering"
#: ``additional_config``'s key of the SAEs the engine holds (``saes=[...]``): their paths, names and digests.
SAES_SETTING = "saes"
#: ``additional_config``'s key of the steering pool's size, in entries (`steering_pool`).
STEERING_ENTRIES = "max_steering_entries"
#: ``additional_config``'s key of the probe columns read at every block (`specs.probes`).
PROBE_COLUMNS_SETTING = "max_probe_columns"
#: The setting naming the values the steering operation acts at (`specs.STEERING_VALUES` by default).
STEERING_VALUES_SETTING = "steering_values"
#: vLLM engine arguments the steered engine sets itself or cannot serve.
_REFUSED = {
    "worker_cls": "the steered engine runs its own worker (vLLM's worker for the platform, re-classed runner)",
    "scheduler_cls": "the steered engine runs vLLM's own scheduler, keeping steered generated tokens out of its cache",
    "speculative_config": "draft tokens would need their own steering rows; speculative decoding is not supported",
    "pipeline_parallel_size": "every rank holds every block's steering; pipeline parallelism is not supported",
    "enable_dbo": "the steering rows and kept rows are laid out over a whole step, not per micro-batch; "
    "micro-batching (dual batch overlap) is not supported",
    "ubatch_size": "the steering rows and kept rows are laid out over a whole step, not per micro-batch; "
    "micro-batching (ubatch_size > 1) is not supported",
}
#: Dotted path of the steered engine's scheduler.
SCHEDULER = "nnterp_vllm.engines.steered.scheduling.PromptCachingScheduler"


def steering_settings(
    model: Any,
    given: dict[str, Any],
    capture_values: Any = None,
    saes: Sequence[SAE] = (),
    directions_per_block: int = DIRECTIONS_PER_BLOCK,
    steering_entries: int | None = None,
    probe_columns: int = PROBE_COLUMNS,
    steering_values: Sequence[str] | None = None,
    config: Any = None,
) -> dict:
    """The vLLM engine arguments a steered engine of ``model`` adds to the caller's ``given`` ones. ``config``:
    ``model``'s, where the caller has read it already (`checkpoints.read_config_with`; read here otherwise).

    The steering worker and scheduler, its settings in ``additional_config`` (the steering pool's entries,
    ``steering_entries``, by default as many as the memory model gives (`memory.default_steering_entries`), and
    direction slots per entry, the values the steering operation acts at, ``steering_values``
    (`checked_steering_values`), the values it keeps, ``capture_values``, and the SAEs it holds, ``saes`` (loaded and
    checked by `held_saes`), among them; they also key vLLM's compile cache apart from plain vLLM's) and this
    platform's defaults (`engine_kwargs`). Refuses what the steered engine cannot serve, a model no vLLM family
    serves, and values it cannot keep, before anything loads.
    """
    refused = {
        "worker_cls": given.get("worker_cls") not in (None, "auto"),
        "scheduler_cls": given.get("scheduler_cls") is not None,
        "speculative_config": given.get("speculative_config") is not None or given.get("spec_method") is not None,
        "pipeline_parallel_size": given.get("pipeline_parallel_size") not in (None, 1),
        "enable_dbo": bool(given.get("enable_dbo")),
        "ubatch_size": (given.get("ubatch_size") or 0) > 1,
    }
    for name, bad in refused.items():
        if bad:
            raise ValueError(f"{name} is refused by the steered engine (got {given[name]!r}): {_REFUSED[name]}")
    for setting, number, least in (
        ("steering_directions_per_block", directions_per_block, 1),
        ("max_steering_entries", steering_entries, 0),
        ("max_probe_columns", probe_columns, 0),
    ):
        if number is not None and (not isinstance(number, int) or isinstance(number, bool) or number < least):
            raise ValueError(f"{setting} must be an int >= {least}, got {number!r}")
    steering_values = checked_steering_values(steering_values)
    choose_model_runner("the steered engine")
    no_saved_graphs("the steered engine")
    config = read_config_with(model, given) if config is None else config
    families.lookup(families.model_type(config), engine=families.VLLM)
    additional = dict(given.get("additional_config") or {})
    kept = kept_values(capture_values, config.get_text_config().num_hidden_layers, additional, saes)
    plain = {name: value for name, value in given.items() if name not in ("worker_cls", "scheduler_cls")}
    # The checkpoint sizes the CPU build's KV cache for its context, as for every engine of ours.
    placed = engine_kwargs(str(model), config, **{**plain, "additional_config": additional})
    if steering_entries is None:
        hidden = config.get_text_config().hidden_size
        steering_entries = default_steering_entries(hidden, getattr(torch, placed["dtype"]), directions_per_block)
    settings = {
        STEERING_ENTRIES: steering_entries,
        PROBE_COLUMNS_SETTING: probe_columns,
        "directions_per_block": directions_per_block,
        STEERING_VALUES_SETTING: steering_values,
        "code": _code_digest(),
        CAPTURE_SETTING: kept,
        SAES_SETTING: [
            {key: getattr(sae, key) for key in ("name", "path", "digest", "layer", "architecture", "d_in", "d_sae")}
            for sae in saes
        ],
    }
    placed["additional_config"] = {**(placed.get("additional_config") or {}), CONFIG_KEY: settings}
    # What this platform's defaults add or replace (the executor of a CPU engine's ranks among them).
    changed = {name: value for name, value in placed.items() if name not in plain or value is not plain[name]}
    return {
        **changed,
        "worker_cls": worker_class(),
        "scheduler_cls": SCHEDULER,
    }


def checked_steering_values(values: Sequence[str] | None) -> list[str]:
    """``steering_values`` checked: some of `specs.STEERING_VALUES`, ``layer_output`` among them (every spec but an
    ablation everywhere or a patch of a sublayer acts there); all of them for ``None``. ValueError naming the fix."""
    if values is None:
        return list(specs.STEERING_VALUES)
    if isinstance(values, str) or not all(isinstance(value, str) for value in values):
        raise ValueError(f"steering_values is a list of value names from {list(specs.STEERING_VALUES)}, got {values!r}")
    unknown = [value for value in values if value not in specs.STEERING_VALUES]
    if unknown:
        raise ValueError(
            f"steering_values: {unknown[0]!r} is not a value the steering operation acts at; choose among "
            f"{list(specs.STEERING_VALUES)}"
        )
    if "layer_output" not in values:
        raise ValueError(
            "steering_values must hold 'layer_output': every Steering, Cap and Clamp acts at the blocks' outputs"
        )
    return [value for value in specs.STEERING_VALUES if value in values]


def kept_values(
    capture_values: Any, num_layers: int, additional_config: dict[str, Any], saes: Sequence[SAE] = ()
) -> list[str]:
    """The value names an engine built with ``capture_values`` keeps (none for ``None``), checked as `Capture`
    checks its values: a block's ``sae_features`` is kept as that block's ``layer_output`` (its features are encoded
    from it), the engine holding an SAE there (``saes``); ValueError for a value after the blocks the engine runs
    (``additional_config``)."""
    if capture_values is None:
        return []
    selectors = capture_specs.static_selectors(capture_values, "capture_values", (SAE_FEATURES,))
    held_at = {sae.layer for sae in saes}
    names = []
    for name in capture_specs.value_names(selectors, num_layers):
        if name.endswith(f".{SAE_FEATURES}"):
            layer = int(name.split(".")[1])
            if layer not in held_at:
                holding = sorted(held_at) or "none"
                raise ValueError(
                    f"capture_values: {name} is encoded by the SAE the engine holds at block {layer}; it holds SAEs at "
                    f"blocks {holding}: add that SAE to saes=[...]"
                )
            name = f"layers.{layer}.layer_output"
        if name not in names:
            names.append(name)
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


def held(config: Any, saes: Any) -> list[SAE]:
    """``saes=[...]`` for a steered engine of the model whose config is ``config``, loaded and checked against it
    (`sae_list`)."""
    text = config.get_text_config()
    return sae_list(saes, text.num_hidden_layers, text.hidden_size)


def held_saes(vllm_config: Any) -> list[SAE]:
    """The SAEs an engine was built to hold (``saes=[...]``), loaded on the worker and checked to be the ones the
    client loaded (their digests)."""
    held = []
    for entry in vllm_config.additional_config[CONFIG_KEY].get(SAES_SETTING, []):
        sae = SAE.load(entry["path"], entry["name"])
        if sae.digest != entry["digest"]:
            raise ValueError(f"saes: {entry['path']} changed on disk since the engine was asked to hold it")
        held.append(sae)
    return held


def steered_engine_args(
    engine_args: EngineArgs,
    capture_values: Any = None,
    saes: Any = None,
    directions_per_block: int = DIRECTIONS_PER_BLOCK,
    steering_entries: int | None = None,
    probe_columns: int = PROBE_COLUMNS,
    steering_values: Sequence[str] | None = None,
) -> EngineArgs:
    """A copy of vLLM ``EngineArgs`` (or ``AsyncEngineArgs``) that builds a steered engine keeping
    ``capture_values``, holding ``saes``, its steering pool of ``steering_entries`` entries (the memory model's
    default where ``None``) of ``directions_per_block`` direction slots each, acting at ``steering_values``."""
    names = (
        "dtype",
        "worker_cls",
        "scheduler_cls",
        "speculative_config",
        "spec_method",
        "pipeline_parallel_size",
        "tensor_parallel_size",
        "distributed_executor_backend",
        "enable_dbo",
        "ubatch_size",
        "revision",
        "trust_remote_code",
        "kv_cache_memory_bytes",
        "additional_config",
    )
    given = {name: getattr(engine_args, name) for name in names if getattr(engine_args, name, None) is not None}
    config = read_config_with(engine_args.model, given)
    settings = steering_settings(
        engine_args.model,
        given,
        capture_values,
        held(config, saes),
        directions_per_block,
        steering_entries,
        probe_columns,
        steering_values,
        config,
    )
    return dataclasses.replace(engine_args, **settings)


def _code_digest() -> str:
    """A digest of the code the compiled graph traces through here (a change recompiles)."""
    here = Path(__file__).parent
    sources = [
        *(
            here.joinpath(name).read_text()
            for name in ("steering_table.py", "steerer.py", "placement.py", "runners.py", "memory.py")
        ),
        inspect.getsource(in_engine_capture),
        inspect.getsource(containment),
        inspect.getsource(on_vllm),
        inspect.getsource(values_module),
        inspect.getsource(specs),
    ]
    return hashlib.sha256("".join(sources).encode()).hexdigest()[:16]


def sizes_of(vllm_config: Any, accelerator: bool, keeps_rows: bool) -> EngineSizes:
    """The `EngineSizes` of a steered engine's ``vllm_config`` (its settings in ``additional_config``)."""
    model_config, scheduler = vllm_config.model_config, vllm_config.scheduler_config
    settings = vllm_config.additional_config[CONFIG_KEY]
    return EngineSizes(
        num_layers=model_config.hf_text_config.num_hidden_layers,
        hidden_size=model_config.get_hidden_size(),
        dtype=model_config.dtype,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        max_num_seqs=scheduler.max_num_seqs,
        steering_entries=settings[STEERING_ENTRIES],
        directions_per_block=settings["directions_per_block"],
        kept_values=len(settings.get(CAPTURE_SETTING, [])),
        saes=memory.held_saes(settings.get(SAES_SETTING, [])),
        accelerator=accelerator,
        keeps_rows=keeps_rows,
        probe_columns=settings.get(PROBE_COLUMNS_SETTING, 0),
    )
