"""The memory model of the steered engine: every buffer this library adds to a vLLM engine, per rank.

One function of the model's sizes, vLLM's scheduler and parallel settings and the engine's own options
(`EngineSizes`) gives each buffer (`Buffer`: its shape and dtype, on the device or pinned on the host, and the
setting that shrinks it). The engines allocate their buffers from it (`Ledger`), as the model loads and before
vLLM profiles memory, so vLLM's profile counts them and what an engine holds is what the model says; a refusal
quotes the same numbers (`check_room`), and ``nnterp-vllm plan`` prints them without loading weights.

What is sized by what:

- **Steering** (every rank: the residual stream is whole on each): a pool of ``max_steering_entries`` entries,
  each one location's content of a request's specs (how much of the stream it keeps, the added vector and whether it
  is a fraction of the stream's norm, then each direction's read and write vectors and its parameters; entry 0 keeps
  the stream and moves nothing), shared by every location and request that needs the same content; a table of
  steering rows (each a distinct set of specs one request applies to some of its tokens, two per running sequence)
  naming an entry per location (each block's output, what its attention and its MLP add, the stream entering the
  first block); and each scheduled token's row. On an accelerator, pinned staging for the entries and rows written
  in one step.
- **Capture** (the rank that keeps rows, when values are kept): the buffer the compiled graph fills, one
  ``[max_num_batched_tokens, hidden]`` row per kept value; on an accelerator the kept rows are gathered on the
  device into a compact buffer of only the rows some request keeps, then copied to the host through two pinned
  buffers of at most `HOST_CHUNK_BYTES` each (together at most one compact step).
- **Probes** (every rank): ``max_probe_columns`` columns (a probe's class, a gate's read), each a hidden-size
  vector, its bias and its block, read together at every block as one small product, and each scheduled token's
  scores.
- **SAEs** held by the engine (``saes=[...]``): their encoders on the device (where rows are kept, and every TopK
  SAE on every rank, since its clamps run inside the forward), and one bounded buffer the features are encoded into.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .steering_pool import locations

#: A steering direction's parameters (bounds, offset, threshold, scale, TopK feature; its gate's column, operator,
#: threshold, floor and sigmoid; whether its bounds are fractions of the stream's norm), float32 each.
STEERING_PARAMS = 12
#: Device memory the default steering pool takes, at most (entries are fewer where they are wide).
STEERING_POOL_BYTES = 32 * 2**20
#: Bounds of the default number of steering entries.
STEERING_ENTRIES_RANGE = (64, 512)
#: Steering entries (and rows) the engine writes in one step through its pinned staging, at most: the scheduler
#: admits no more new content in one step (beyond one request's own).
STEERING_WRITES_PER_STEP = 128
#: Steering rows per running sequence: its prompt's and its generated tokens' (listed positions take more).
STEERING_ROWS_PER_SEQUENCE = 2
#: Pinned host buffers kept rows arrive in from an accelerator, in turn.
HOST_BUFFERS = 2
#: Bytes of each of them, at most: a larger step goes through them in parts.
HOST_CHUNK_BYTES = 32 * 2**20
#: Bytes of the buffer SAE features are encoded into, at most: larger sets of rows are encoded in parts.
SAE_ENCODING_BYTES = 64 * 2**20
#: Probe columns (a probe's class, or a gate's read) the engine reads at every block unless told.
PROBE_COLUMNS = 16


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer the engine allocates: its shape and dtype, where it lives (the device, or pinned host memory),
    and the setting that shrinks it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pinned: bool
    setting: str

    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class HeldSAE:
    """What the memory model reads of an SAE the engine holds."""

    name: str
    d_in: int
    d_sae: int
    architecture: str

    def vectors(self) -> list[str]:
        """The ``[d_sae]`` vectors its encoder needs beside ``W_enc``: ``b_enc``, a JumpReLU's threshold, a TopK's
        decoder norms (its pre-activations are rescaled by them where the SAE says so; ones otherwise)."""
        return ["b_enc", *{"jumprelu": ["threshold"], "topk": ["decoder_norms"]}.get(self.architecture, [])]


@dataclasses.dataclass(frozen=True)
class EngineSizes:
    """Everything the memory model reads: the model's sizes, vLLM's scheduler settings, and the engine's options,
    for one rank."""

    num_layers: int
    hidden_size: int
    dtype: torch.dtype
    max_num_batched_tokens: int
    max_num_seqs: int
    steering_entries: int
    directions_per_block: int
    #: Values this rank keeps (none on tensor-parallel ranks after the first).
    kept_values: int
    saes: tuple[HeldSAE, ...]
    #: Whether the engine runs on an accelerator (staging and pinned host buffers) rather than the CPU.
    accelerator: bool
    #: Whether this rank keeps captured rows (and so holds every SAE for encoding them).
    keeps_rows: bool = True
    #: Probe columns read at every block (`specs.probes`).
    probe_columns: int = 0

    @property
    def steering_rows(self) -> int:
        """Steering rows, beside row 0 (no steering)."""
        return STEERING_ROWS_PER_SEQUENCE * self.max_num_seqs

    @property
    def steering_writes(self) -> int:
        """Entries (and rows) written through the pinned staging in one step."""
        return min(self.steering_entries, STEERING_WRITES_PER_STEP)

    @property
    def kept_rows(self) -> int:
        """Rows one step may keep: every kept value of every scheduled token."""
        return self.kept_values * self.max_num_batched_tokens

    @property
    def host_rows(self) -> int:
        """Rows each pinned host buffer of kept rows holds."""
        per_buffer = -(-self.kept_rows // HOST_BUFFERS)
        return max(1, min(per_buffer, HOST_CHUNK_BYTES // (self.hidden_size * self.dtype.itemsize)))

    def encoding_rows(self, d_sae: int) -> int:
        """Rows encoded into an SAE's ``d_sae`` features at once."""
        return max(1, min(self.max_num_batched_tokens, SAE_ENCODING_BYTES // (4 * d_sae)))


def default_steering_entries(hidden_size: int, dtype: torch.dtype, directions_per_block: int) -> int:
    """The steering pool's size unless the engine is told (``max_steering_entries``): as many entries as
    `STEERING_POOL_BYTES` holds, within `STEERING_ENTRIES_RANGE`."""
    low, high = STEERING_ENTRIES_RANGE
    entry = steering_entry_bytes(hidden_size, dtype, directions_per_block)
    return max(low, min(high, STEERING_POOL_BYTES // entry))


def steering_entry_bytes(hidden_size: int, dtype: torch.dtype, directions_per_block: int) -> int:
    """Device bytes of one steering entry: its vectors and its directions' parameters."""
    return (1 + 2 * directions_per_block) * hidden_size * dtype.itemsize + directions_per_block * STEERING_PARAMS * 4


def steering_buffers(sizes: EngineSizes) -> list[Buffer]:
    """The steering buffers of one rank (`EngineSizes`)."""
    entries, directions, hidden = sizes.steering_entries + 1, sizes.directions_per_block, sizes.hidden_size
    located = locations(sizes.num_layers)
    pool = "max_steering_entries, steering_directions_per_block"
    buffers = [
        Buffer("steering vectors", (entries, 1 + 2 * directions, hidden), sizes.dtype, False, pool),
        Buffer("steering parameters", (entries, directions, STEERING_PARAMS), torch.float32, False, pool),
        Buffer("steering keep", (entries,), torch.float32, False, pool),
        Buffer("steering relative", (entries,), torch.float32, False, pool),
        Buffer("steering rows", (located, sizes.steering_rows + 1), torch.int32, False, "max_num_seqs"),
        Buffer("steering token rows", (sizes.max_num_batched_tokens,), torch.int64, False, "max_num_batched_tokens"),
    ]
    if sizes.accelerator:
        written = sizes.steering_writes
        buffers += [
            Buffer("steering vectors written", (written, 1 + 2 * directions, hidden), sizes.dtype, True, pool),
            Buffer("steering parameters written", (written, directions, STEERING_PARAMS), torch.float32, True, pool),
            Buffer("steering keep written", (written,), torch.float32, True, pool),
            Buffer("steering relative written", (written,), torch.float32, True, pool),
            Buffer("steering rows written", (written, located), torch.int32, True, "max_num_seqs"),
            Buffer(
                "steering token rows written",
                (sizes.max_num_batched_tokens,),
                torch.int64,
                True,
                "max_num_batched_tokens",
            ),
        ]
    return buffers


def probe_buffers(sizes: EngineSizes) -> list[Buffer]:
    """The probe columns of one rank (none where the engine reads none): every column's weights, bias and block,
    and each scheduled token's scores, written where its block's stream passes."""
    columns = sizes.probe_columns
    if not columns:
        return []
    setting, tokens = "max_probe_columns", sizes.max_num_batched_tokens
    buffers = [
        Buffer("probe weights", (columns, sizes.hidden_size), sizes.dtype, False, setting),
        Buffer("probe bias", (columns,), torch.float32, False, setting),
        Buffer("probe blocks", (columns,), torch.int64, False, setting),
        Buffer("probe scores", (tokens, columns), torch.float32, False, f"{setting}, max_num_batched_tokens"),
    ]
    if sizes.accelerator:
        written = min(columns, sizes.steering_writes)
        buffers += [
            Buffer("probe weights written", (written, sizes.hidden_size), sizes.dtype, True, setting),
            Buffer("probe bias written", (written,), torch.float32, True, setting),
            Buffer("probe blocks written", (written,), torch.int64, True, setting),
        ]
    return buffers


def capture_buffers(sizes: EngineSizes) -> list[Buffer]:
    """The capture buffers of one rank: none where it keeps no rows or no value."""
    if not sizes.keeps_rows or not sizes.kept_values:
        return []
    kept = "capture_values, max_num_batched_tokens"
    shape = (sizes.kept_values, sizes.max_num_batched_tokens, sizes.hidden_size)
    buffers = [Buffer("capture buffer", shape, sizes.dtype, False, kept)]
    if sizes.accelerator:
        rows = sizes.kept_rows
        buffers += [
            Buffer("capture compact rows", (rows, sizes.hidden_size), sizes.dtype, False, kept),
            Buffer("capture row index", (rows,), torch.int64, False, kept),
            Buffer("capture row index written", (rows,), torch.int64, True, kept),
            Buffer(
                "capture rows on the host",
                (HOST_BUFFERS, sizes.host_rows, sizes.hidden_size),
                sizes.dtype,
                True,
                f"fixed: at most {HOST_BUFFERS} x {HOST_CHUNK_BYTES // 2**20} MiB",
            ),
        ]
    return buffers


def sae_buffers(sizes: EngineSizes) -> list[Buffer]:
    """The held SAEs' encoders this rank places on its device, and the buffer their features are encoded into."""
    held = [sae for sae in sizes.saes if sizes.keeps_rows or sae.architecture == "topk"]
    buffers = []
    for sae in held:
        setting = f"saes ({sae.name})"
        buffers.append(Buffer(f"SAE {sae.name} W_enc", (sae.d_in, sae.d_sae), torch.float32, False, setting))
        buffers.append(Buffer(f"SAE {sae.name} b_dec", (sae.d_in,), torch.float32, False, setting))
        for vector in sae.vectors():
            buffers.append(Buffer(f"SAE {sae.name} {vector}", (sae.d_sae,), torch.float32, False, setting))
    if held:
        widest = max(sae.d_sae for sae in held)
        rows = sizes.encoding_rows(widest)
        buffers.append(Buffer("SAE encoding", (rows, widest), torch.float32, False, "saes"))
    return buffers


def engine_buffers(sizes: EngineSizes) -> dict[str, Buffer]:
    """Every buffer one rank of a steered engine allocates, by name."""
    made = steering_buffers(sizes) + probe_buffers(sizes) + capture_buffers(sizes) + sae_buffers(sizes)
    return {buffer.name: buffer for buffer in made}


def total(buffers: Iterable[Buffer], pinned: bool) -> int:
    """Bytes of ``buffers`` on the device (``pinned`` false) or pinned on the host."""
    return sum(buffer.nbytes for buffer in buffers if buffer.pinned == pinned)


class Ledger:
    """The buffers of one rank (`engine_buffers`), allocated as the engine's parts ask for them by name, and what
    was allocated (the tensors themselves: what an engine holds is what they are)."""

    def __init__(self, buffers: dict[str, Buffer], device: Any) -> None:
        self.buffers, self.device = buffers, device
        self.tensors: dict[str, torch.Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.buffers

    def allocate(self, name: str, fill: float | None = 0.0) -> torch.Tensor:
        """Buffer ``name`` as a tensor on the device (pinned host memory for a pinned buffer), zeros unless ``fill``
        says otherwise (``None``: uninitialised)."""
        buffer = self.buffers[name]
        if buffer.pinned:
            tensor = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=torch.device(self.device).type != "cpu")
        else:
            with torch.inference_mode(False):  # a persistent buffer, written in place by every step
                tensor = torch.empty(buffer.shape, dtype=buffer.dtype, device=self.device)
        if fill is not None:
            tensor.fill_(fill)
        self.tensors[name] = tensor
        return tensor

    def held(self) -> dict[str, dict[str, Any]]:
        """What was allocated: each buffer's bytes, shape, dtype and whether it is host memory."""
        return {
            name: {
                "nbytes": tensor.nbytes,
                "shape": list(tensor.shape),
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "host": tensor.device.type == "cpu" and torch.device(self.device).type != "cpu",
            }
            for name, tensor in self.tensors.items()
        }


def held_saes(entries: Sequence[dict[str, Any]]) -> tuple[HeldSAE, ...]:
    """The memory model's view of the SAEs an engine's settings list."""
    return tuple(HeldSAE(sae["name"], sae["d_in"], sae["d_sae"], sae["architecture"]) for sae in entries)


def check_room(buffers: dict[str, Buffer], left: int) -> None:
    """Refuse, naming each buffer's size and the setting that shrinks it, device buffers that do not fit in the
    ``left`` bytes of the device this engine may still take."""
    device = [buffer for buffer in buffers.values() if not buffer.pinned]
    needed = total(device, pinned=False)
    if needed <= left:
        return
    each = ", ".join(f"{buffer.name} {buffer.nbytes / 2**30:.2f} GiB ({buffer.setting})" for buffer in device)
    raise ValueError(
        f"the steered engine's buffers need {needed / 2**30:.2f} GiB of the device ({each}), but "
        f"{max(left, 0) / 2**30:.2f} GiB of it is left to this engine after its weights (gpu_memory_utilization, or "
        "kv_cache_memory_bytes). Lower the setting named beside the largest, or raise gpu_memory_utilization."
    )


__all__ = [
    "Buffer",
    "EngineSizes",
    "HeldSAE",
    "Ledger",
    "check_room",
    "default_steering_entries",
    "engine_buffers",
    "total",
]
