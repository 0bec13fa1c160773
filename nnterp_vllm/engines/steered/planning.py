"""``nnterp-vllm plan``: what a steered engine of a model takes of a GPU, per rank, before renting one.

From the model's config alone (no weights: the parameters are counted on the meta device), vLLM's defaults for the
device (its own `get_batch_defaults`, asked as that device would answer it), the tensor-parallel size and the
engine's options, it gives every buffer the memory model (`memory.engine_buffers`) allocates per rank, the
weights' share of each rank, an estimate of the activations vLLM's memory profile will see, and what that leaves
vLLM's KV cache of ``gpu_memory_utilization`` x the device: its bytes and tokens.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ... import checkpoints
from .memory import (
    Buffer,
    EngineSizes,
    HeldSAE,
    default_steering_entries,
    engine_buffers,
    total,
)

#: vLLM's share of the device unless told (``gpu_memory_utilization``).
GPU_MEMORY_UTILIZATION = 0.92


@dataclasses.dataclass(frozen=True)
class Device:
    """A GPU as vLLM asks about it: its name and the memory CUDA reports for it."""

    name: str
    memory: int


GiB = 2**30
#: The devices a plan is made for, with the total memory CUDA reports on each.
DEVICES = {
    "h100": Device("NVIDIA H100 80GB HBM3", int(79.19 * GiB)),
    "h200": Device("NVIDIA H200", int(139.80 * GiB)),
    "a100-80g": Device("NVIDIA A100-SXM4-80GB", int(79.15 * GiB)),
    "b200": Device("NVIDIA B200", int(178.35 * GiB)),
}


@dataclasses.dataclass
class EnginePlan:
    """A steered engine of a model on one device kind, per rank."""

    model: str
    device: str
    device_memory: int
    tensor_parallel_size: int
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    max_num_seqs: int
    dtype: torch.dtype
    weights: int
    activations: int
    kv_bytes_per_token: int
    #: The buffers of the first rank (which keeps captured rows) and of every other rank.
    first_rank: dict[str, Buffer]
    other_ranks: dict[str, Buffer] | None

    @property
    def budget(self) -> int:
        """What vLLM may take of the device: ``gpu_memory_utilization`` x its memory."""
        return int(self.gpu_memory_utilization * self.device_memory)

    @property
    def ours(self) -> int:
        """Device bytes of this library's buffers on the first rank (the larger)."""
        return total(self.first_rank.values(), pinned=False)

    @property
    def kv_cache(self) -> int:
        """What is left of the budget for vLLM's KV cache on the first rank (negative: the model does not fit)."""
        return self.budget - self.weights - self.activations - self.ours

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV cache that leaves (per rank; every rank holds its heads of every token)."""
        return max(0, self.kv_cache) // self.kv_bytes_per_token

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain data (bytes), as ``nnterp-vllm plan --json`` prints it."""

        def listed(buffers: dict[str, Buffer] | None) -> list[dict[str, Any]] | None:
            if buffers is None:
                return None
            return [
                {
                    "name": buffer.name,
                    "where": "pinned host" if buffer.pinned else "device",
                    "shape": list(buffer.shape),
                    "dtype": str(buffer.dtype).removeprefix("torch."),
                    "bytes": buffer.nbytes,
                    "setting": buffer.setting,
                }
                for buffer in buffers.values()
            ]

        return {
            "model": self.model,
            "device": self.device,
            "device_memory": self.device_memory,
            "tensor_parallel_size": self.tensor_parallel_size,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "dtype": str(self.dtype).removeprefix("torch."),
            "weights": self.weights,
            "activations": self.activations,
            "buffers_device": self.ours,
            "buffers_pinned_host": total(self.first_rank.values(), pinned=True),
            "kv_cache": self.kv_cache,
            "kv_tokens": self.kv_tokens,
            "first_rank": listed(self.first_rank),
            "other_ranks": listed(self.other_ranks),
        }


def batch_defaults(device: Device, world_size: int, server: bool) -> tuple[int, int]:
    """vLLM's own defaults for ``max_num_batched_tokens`` and ``max_num_seqs`` on ``device`` (its
    ``EngineArgs.get_batch_defaults``, asked with the device's name and memory), for an ``LLM`` or, where
    ``server``, the OpenAI server."""
    from vllm.engine import arg_utils
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    class Asked:
        """The platform as that device's would answer ``get_batch_defaults``."""

        @staticmethod
        def get_device_total_memory() -> int:
            return device.memory

        @staticmethod
        def get_device_name() -> str:
            return device.name

        is_tpu = is_cpu = staticmethod(lambda: False)

    platform = arg_utils.current_platform
    arg_utils.current_platform = Asked()
    try:
        tokens, sequences = EngineArgs.get_batch_defaults(world_size)
    finally:
        arg_utils.current_platform = platform
    usage = UsageContext.OPENAI_API_SERVER if server else UsageContext.LLM_CLASS
    return tokens[usage], sequences[usage]


def parameter_count(config: Any) -> int:
    """The model's parameters, counted on the meta device (no weights read or allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(parameter.numel() for parameter in model.parameters())


def activation_estimate(config: Any, tokens: int, sequences: int, tensor_parallel_size: int, dtype: Any) -> int:
    """An estimate of the activations vLLM's memory profile sees on a rank: one block's widest intermediates over
    a step of ``tokens`` tokens (the attention's projections, the MLP's or the routed experts' gate, up and output),
    and the sampler's float32 logits over ``sequences`` sequences, twice. vLLM measures the real peak as it
    starts."""
    text = config.get_text_config()
    hidden, vocab = text.hidden_size, text.vocab_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    attention = (heads + 2 * kv_heads) * head_dim // tensor_parallel_size + hidden
    routed = getattr(text, "num_experts_per_tok", None)
    width = getattr(text, "moe_intermediate_size", None) if routed else None
    width = (width or text.intermediate_size) * (routed or 1)
    mlp = 3 * width // tensor_parallel_size + hidden
    element = torch.empty((), dtype=dtype).element_size()
    return tokens * (2 * hidden + max(attention, mlp)) * element + 2 * sequences * vocab * 4


def plan(
    model: str,
    device: str = "h100",
    tensor_parallel_size: int = 1,
    *,
    server: bool = False,
    dtype: str | None = None,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    max_steering_entries: int | None = None,
    directions_per_block: int | None = None,
    capture_values: Sequence[str] | None = None,
    saes: Sequence[str] = (),
) -> EnginePlan:
    """The plan of a steered engine of ``model`` (a hub id, a checkpoint directory or a ``config.json``) on
    ``device`` (`DEVICES`) split over ``tensor_parallel_size`` ranks; every other argument as the engine takes it
    (vLLM's defaults for the device where ``None``). Reads the config only. ``ValueError`` naming what is wrong."""
    from ...specs import capture as capture_specs
    from ...specs.steering_requests import DIRECTIONS_PER_BLOCK
    from ..engine_defaults import kv_bytes_per_token

    if device not in DEVICES:
        raise ValueError(f"plan: device must be one of {', '.join(DEVICES)}, got {device!r}")
    for name, number in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("max_num_seqs", max_num_seqs),
        ("max_steering_entries", max_steering_entries),
        ("steering_directions_per_block", directions_per_block),
    ):
        if number is not None and (not isinstance(number, int) or isinstance(number, bool) or number < 1):
            raise ValueError(f"plan: {name} must be an int >= 1, got {number!r}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"plan: gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    config = read_config(model)
    text = config.get_text_config()
    chosen = DEVICES[device]
    tokens, sequences = batch_defaults(chosen, tensor_parallel_size, server)
    tokens, sequences = max_num_batched_tokens or tokens, max_num_seqs or sequences
    held_dtype = model_dtype(config, dtype)
    directions = directions_per_block or DIRECTIONS_PER_BLOCK
    entries = max_steering_entries or default_steering_entries(text.hidden_size, held_dtype, directions)
    kept = 0
    if capture_values:
        selectors = capture_specs.static_selectors(list(capture_values), "plan: capture_values")
        kept = len(capture_specs.value_names(selectors, text.num_hidden_layers))
    held = tuple(sae_sizes(path) for path in saes)

    def rank(keeps_rows: bool) -> dict[str, Buffer]:
        sizes = EngineSizes(
            text.num_hidden_layers,
            text.hidden_size,
            held_dtype,
            tokens,
            sequences,
            entries,
            directions,
            kept if keeps_rows else 0,
            held,
            accelerator=True,
            keeps_rows=keeps_rows,
        )
        return engine_buffers(sizes)

    per_token = kv_bytes_per_token(config, str(held_dtype).removeprefix("torch."))
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    share = max(1, kv_heads // tensor_parallel_size) / kv_heads
    return EnginePlan(
        model=str(model),
        device=device,
        device_memory=chosen.memory,
        tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization,
        max_num_batched_tokens=tokens,
        max_num_seqs=sequences,
        dtype=held_dtype,
        weights=parameter_count(config) * held_dtype.itemsize // tensor_parallel_size,
        activations=activation_estimate(config, tokens, sequences, tensor_parallel_size, held_dtype),
        kv_bytes_per_token=max(1, int((per_token or 0) * share)),
        first_rank=rank(True),
        other_ranks=rank(False) if tensor_parallel_size > 1 else None,
    )


def read_config(model: str) -> Any:
    """The config of ``model``: a ``config.json`` file, or a checkpoint directory or hub id
    (`checkpoints.read_config`)."""
    path = Path(model)
    if path.is_file():
        from transformers import AutoConfig

        data = json.loads(path.read_text())
        if "model_type" not in data:
            raise ValueError(f"plan: {path} names no model_type; give a model's config.json")
        return AutoConfig.for_model(data.pop("model_type"), **data)
    return checkpoints.read_config(model)


def model_dtype(config: Any, dtype: str | None) -> torch.dtype:
    """The dtype the engine runs the model in: ``dtype`` where given, else the checkpoint's own."""
    from ...dtypes import checkpoint_dtype

    if dtype is not None:
        named = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(named, torch.dtype) or not named.is_floating_point:
            raise ValueError(f"plan: dtype must be a floating dtype's name such as 'bfloat16', got {dtype!r}")
        return named
    return checkpoint_dtype(config)


def sae_sizes(path: str) -> HeldSAE:
    """What the memory model needs of a SAELens SAE directory, read from its config and its weights' header only."""
    from safetensors import safe_open

    from ...specs.saes import WEIGHTS_FILE, read_config

    directory = Path(path)
    config, _, _ = read_config(directory, "plan: sae")
    with safe_open(directory / WEIGHTS_FILE, "pt") as handle:
        d_in, d_sae = handle.get_slice("W_enc").get_shape()
    return HeldSAE(directory.name, d_in, d_sae, config.get("architecture", "standard"))


def printed(plan: EnginePlan) -> str:
    """The plan as ``nnterp-vllm plan`` prints it."""

    def size(count: int) -> str:
        return f"{count / 2**20:10.1f} MiB" if abs(count) < 2**30 else f"{count / 2**30:10.2f} GiB"

    lines = [
        f"{plan.model} on {plan.device} ({plan.device_memory / 2**30:.1f} GiB), tensor_parallel_size="
        f"{plan.tensor_parallel_size}, {str(plan.dtype).removeprefix('torch.')}",
        f"vLLM's defaults there: max_num_batched_tokens={plan.max_num_batched_tokens}, "
        f"max_num_seqs={plan.max_num_seqs}",
        "",
    ]
    ranks = [("rank 0" if plan.other_ranks else "each rank", plan.first_rank)]
    if plan.other_ranks is not None:
        ranks.append((f"ranks 1..{plan.tensor_parallel_size - 1}", plan.other_ranks))
    for title, buffers in ranks:
        lines.append(f"This library's buffers, {title}:")
        for buffer in buffers.values():
            where = "host (pinned)" if buffer.pinned else "device"
            shape = " x ".join(str(size) for size in buffer.shape)
            lines.append(f"  {buffer.name:32s} {where:14s} {size(buffer.nbytes)}  [{shape}]  shrink: {buffer.setting}")
        lines.append(f"  {'device in all':32s} {'':14s} {size(total(buffers.values(), pinned=False))}")
        lines.append(f"  {'pinned host in all':32s} {'':14s} {size(total(buffers.values(), pinned=True))}")
        lines.append("")
    lines += [
        f"Per rank, of gpu_memory_utilization={plan.gpu_memory_utilization} x the device "
        f"({size(plan.budget).strip()}):",
        f"  weights                          {size(plan.weights)}",
        f"  activations (estimate)           {size(plan.activations)}",
        f"  this library's buffers           {size(plan.ours)}",
        f"  vLLM's KV cache (what is left)   {size(plan.kv_cache)}  ~{plan.kv_tokens:,} tokens",
    ]
    if plan.kv_cache <= 0:
        lines.append(
            "  does not fit: raise tensor_parallel_size or gpu_memory_utilization, or lower the settings above"
        )
    return "\n".join(lines)


__all__ = ["DEVICES", "EnginePlan", "batch_defaults", "plan", "printed"]
