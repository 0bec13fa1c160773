"""The keys a request's earlier tokens left in vLLM's paged KV cache, read back for one attention kernel.

At a step after a request's first, vLLM's attention kernel reads the earlier tokens' keys from its paged KV cache
and receives only the new tokens' keys. Each backend lays a cache block out its own way (the CPU kernels pack it
per instruction set, the GPU ones per kernel), so the layout is not assumed: it is learnt once per cache shape by
handing the backend's own cache writer (``impl.do_kv_cache_update``) probe keys that number every
``(token, head, dim)`` of one block into a scratch block, and reading where each number landed. Keys then come back
with one gather per read. A cache that is not a plain copy of the keys (a quantized one), a backend that writes its
cache inside its kernel, or one whose metadata holds no block table, serves no earlier keys, with the reason.
"""

from __future__ import annotations

from typing import Any

import torch

#: Probe digits are below this: every float dtype a cache holds represents 0..255 exactly.
DIGIT = 256
#: Learnt layouts: (backend, instruction set, dtype, device, block shape) -> per-block flat index of each key entry.
_LAYOUTS: dict[tuple, torch.Tensor] = {}


def unreadable_reason(kernel: torch.nn.Module) -> str | None:
    """Why ``kernel``'s (a vLLM ``Attention`` layer's) cache cannot be read back for its earlier keys, or ``None``."""
    impl = kernel.impl
    backend = type(impl).__name__
    if str(getattr(kernel, "kv_cache_dtype", "auto")) != "auto":
        return f"its KV cache is stored as {kernel.kv_cache_dtype}, not as the keys themselves"
    if getattr(kernel, "kv_sharing_target_layer_name", None) is not None:
        return f"it reads the KV cache of {kernel.kv_sharing_target_layer_name} and writes none of its own"
    if not hasattr(impl, "do_kv_cache_update") or getattr(kernel.attn_backend, "forward_includes_kv_cache_update", 0):
        return f"vLLM's {backend} writes its KV cache inside its kernel, with no writer of its own to learn it from"
    return None


def _layout(kernel: torch.nn.Module, cache: torch.Tensor) -> torch.Tensor:
    """``[block_size, kv_heads, head_dim]`` flat offsets, within one block of ``cache`` in logical order, of each key
    entry, learnt from the backend's own writer (see the module's docstring)."""
    impl = kernel.impl
    _, heads, block_size, _ = cache.shape
    key = (type(impl), getattr(kernel, "isa", None), cache.dtype, cache.device, tuple(cache.shape[1:]))
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    head_dim = kernel.head_size
    entries = block_size * heads * head_dim
    numbers = torch.arange(entries, device=cache.device).view(block_size, heads, head_dim)
    slots = torch.arange(block_size, device=cache.device, dtype=torch.int64)
    landed = torch.zeros(cache[:1].numel(), dtype=torch.int64, device=cache.device)
    written = torch.zeros_like(landed, dtype=torch.bool)
    place, digits = 1, 0
    while place < entries or digits == 0:
        scratch = torch.full_like(cache[:1], -1.0)
        probe = ((numbers // place) % DIGIT).to(cache.dtype)
        impl.do_kv_cache_update(kernel, probe, torch.full_like(probe, -2.0), scratch, slots)
        flat = scratch.reshape(-1)
        keys = flat >= 0
        written |= keys
        landed += torch.where(keys, flat.to(torch.int64), 0) * place
        place, digits = place * DIGIT, digits + 1
    offsets = torch.full((entries,), -1, dtype=torch.int64, device=cache.device)
    where = written.nonzero().squeeze(1)
    offsets[landed[where]] = where
    if int(written.sum()) != entries or bool((offsets < 0).any()):
        raise RuntimeError(f"vLLM's {type(impl).__name__} does not store each key entry once in its cache block")
    _LAYOUTS[key] = offsets.view(block_size, heads, head_dim)
    return _LAYOUTS[key]


def earlier_tokens(metadata: Any, row: int, first_token: int) -> int:
    """How many of request ``row``'s tokens came before this step (``first_token``: where its tokens start in the
    step's flat batch), from the step's attention metadata."""
    for field in ("block_table", "seq_lens", "query_start_loc"):
        if not isinstance(getattr(metadata, field, None), torch.Tensor):
            raise RuntimeError(f"vLLM's {type(metadata).__name__} holds no {field} to find a request's cached keys")
    starts = metadata.query_start_loc
    if int(starts[row]) != first_token:
        raise RuntimeError(f"request row {row} starts at token {int(starts[row])} of the step, not {first_token}")
    return int(metadata.seq_lens[row]) - int(starts[row + 1] - starts[row])


def earlier_keys(kernel: torch.nn.Module, metadata: Any, row: int, first_token: int, last: int | None) -> torch.Tensor:
    """The keys of request ``row``'s tokens before this step (the ``last`` of them, if given),
    ``[tokens, kv_heads * head_dim]`` (this rank's heads), from ``kernel``'s paged cache (see `earlier_tokens`).

    Called where the kernel receives its inputs, before it writes this step's keys."""
    earlier = earlier_tokens(metadata, row, first_token)
    cache = kernel.kv_cache
    offsets = _layout(kernel, cache)
    block_size = offsets.shape[0]
    positions = torch.arange(0 if last is None else max(earlier - last, 0), earlier, device=cache.device)
    first_block = int(positions[0]) // block_size if len(positions) else 0
    table = metadata.block_table[row, first_block : -(-earlier // block_size)]
    blocks = cache[table.to(cache.device)].reshape(-1)
    within = positions // block_size - first_block
    at = (within * cache[0].numel()).view(-1, 1, 1) + offsets[positions % block_size]
    return blocks[at].reshape(len(positions), offsets[0].numel())
