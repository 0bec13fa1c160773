"""Argument checks shared by every public method and by declarative specs, on either engine.

Each check takes what it checks against (a layer count, a width, a sequence length) as a plain
number, so the nnsight methods (``steer``, ``skip_layers``, ...) and the engine's own steering
specs refuse the same bad input with the same message. ``what`` names the caller in the message.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

LayerSelection = int | Iterable[int]
Positions = int | slice | Iterable[int] | None


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int (``bool`` is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def listed_ints(value: Any) -> list[int] | None:
    """``value`` as a list when it is a non-empty iterable of ints (not text, not a tensor); else ``None``."""
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, torch.Tensor)):
        listed = list(value)
        if listed and all(is_int(i) for i in listed):
            return listed
    return None


def layer_list(layers: LayerSelection, what: str) -> list[int]:
    """``layers`` (an int or ints) as a list, checked for type only: no model is needed."""
    chosen = [layers] if is_int(layers) else listed_ints(layers)
    if chosen is None:
        raise ValueError(f"{what}: layers must be an int or a non-empty list of ints, got {layers!r}")
    return chosen


def layer_indices(layers: LayerSelection, num_layers: int, what: str) -> list[int]:
    """``layers`` (an int or ints, negative counting from the end) as sorted distinct indices ``0..num_layers-1``."""
    chosen = layer_list(layers, what)
    bad = [i for i in chosen if not -num_layers <= i < num_layers]
    if bad:
        raise ValueError(
            f"{what}: layer(s) {bad} do not exist; the model has num_layers={num_layers} (0..{num_layers - 1})"
        )
    return sorted({i % num_layers for i in chosen})


def hidden_vector(vector: Any, hidden_size: int, what: str, rows: bool = True) -> torch.Tensor:
    """``vector`` checked as a finite floating ``[hidden_size]`` tensor (or ``[n, hidden_size]`` where ``rows``)."""
    _floating(vector, what)
    if vector.shape[-1:] != (hidden_size,) or vector.dim() > (2 if rows else 1):
        expected = f"[hidden_size] = [{hidden_size}]" + (f" (or [n, {hidden_size}])" if rows else "")
        raise ValueError(f"{what}: the vector must have shape {expected}, got {list(vector.shape)}")
    return _finite(vector, what)


def number_list(values: Sequence[Any], what: str) -> None:
    """Refuse a list meant as a vector that is empty or holds an element that is not a finite real number,
    naming the first bad element by its index."""
    if not values:
        raise ValueError(f"{what}: the vector must be a torch.Tensor or a non-empty list of floats, got []")
    for index, value in enumerate(values):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(
                f"{what}: the vector must be a torch.Tensor or a non-empty list of floats; element {index} is "
                f"{value!r:.40} ({type(value).__name__})"
            )
        if not math.isfinite(value):
            raise ValueError(f"{what}: the vector holds NaN or inf values: element {index} is {value!r}")


def one_vector(vector: Any, what: str) -> torch.Tensor:
    """``vector`` (a tensor, or a list of real numbers taken as float32) checked as a finite floating 1-D
    tensor; its width is checked against a model with `hidden_vector`."""
    if isinstance(vector, (list, tuple)):
        number_list(vector, what)
        vector = torch.tensor(vector, dtype=torch.float32)
    elif not isinstance(vector, torch.Tensor):
        kind = type(vector).__name__
        raise ValueError(f"{what}: the vector must be a torch.Tensor or a list of floats, got {kind}")
    _floating(vector, what)
    if vector.dim() != 1:
        raise ValueError(f"{what}: the vector must have shape [hidden_size], got {list(vector.shape)}")
    return _finite(vector, what)


def _floating(vector: Any, what: str) -> None:
    if not isinstance(vector, torch.Tensor):
        raise ValueError(f"{what}: the vector must be a torch.Tensor, got {type(vector).__name__}")
    if vector.is_meta:
        raise ValueError(
            f"{what}: the vector is on the meta device, which holds no values; give a tensor with values "
            "(e.g. on the CPU: load or compute it there)"
        )
    if not vector.is_floating_point():
        raise ValueError(f"{what}: the vector must have a floating dtype, got {vector.dtype}")


def _finite(vector: torch.Tensor, what: str) -> torch.Tensor:
    finite = torch.isfinite(vector)
    if not finite.all():
        index = int((~finite).flatten().nonzero()[0])
        raise ValueError(
            f"{what}: the vector holds NaN or inf values: element {index} is {float(vector.flatten()[index])}"
        )
    return vector


def finite_number(value: Any, what: str, name: str = "factor") -> float:
    """``value`` checked as a finite int or float."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{what}: {name} must be a finite number, got {value!r}")
    return float(value)


def positions(chosen: Positions, what: str) -> int | slice | list[int]:
    """``chosen`` positions in a normal form: ``slice(None)`` for all (``None``), an int, a slice, or a list of ints."""
    if chosen is None:
        return slice(None)
    if is_int(chosen) or isinstance(chosen, slice):
        if isinstance(chosen, slice) and not all(
            part is None or is_int(part) for part in (chosen.start, chosen.stop, chosen.step)
        ):
            raise ValueError(f"{what}: a slice of positions takes ints, got {chosen!r}")
        return chosen
    listed = listed_ints(chosen)
    if listed is not None:
        return listed
    raise ValueError(f"{what}: positions must be None, an int, a slice or a non-empty list of ints, got {chosen!r}")


def positions_within(chosen: int | slice | list[int], length: int, what: str) -> list[int]:
    """The positions ``chosen`` selects in a sequence of ``length`` tokens; refuses any outside it or none at all."""
    if isinstance(chosen, slice):
        for part in (chosen.start, chosen.stop):
            if part is not None and not -length <= part <= length:
                raise ValueError(
                    f"{what}: the slice {chosen!r} reaches past the sequence's {length} tokens "
                    f"(bounds must lie in -{length}..{length})"
                )
        selected = list(range(length))[chosen]
        if not selected:
            raise ValueError(f"{what}: the slice {chosen!r} selects no position of the sequence's {length} tokens")
        return selected
    listed: Sequence[int] = [chosen] if is_int(chosen) else chosen
    bad = [i for i in listed if not -length <= i < length]
    if bad:
        raise ValueError(
            f"{what}: position(s) {bad} are outside the sequence's {length} tokens (valid: 0..{length - 1}, "
            f"or -{length}..-1)"
        )
    return [i % length for i in listed]


def batch_rows(chosen: Any, what: str) -> list[int] | None:
    """``batch_index`` as a list of ints, ``None`` for every row; refuses anything else."""
    if chosen is None:
        return None
    rows = [chosen] if is_int(chosen) else listed_ints(chosen)
    if rows is None:
        raise ValueError(f"{what}: batch_index must be None, an int or a non-empty list of ints, got {chosen!r}")
    return rows


def batch_rows_within(rows: list[int] | None, size: int, what: str) -> list[int]:
    """The rows of an invoke's batch of ``size`` prompts that ``rows`` selects (all where ``None``)."""
    if rows is None:
        return list(range(size))
    bad = [row for row in rows if not -size <= row < size]
    if bad:
        raise ValueError(
            f"{what}: batch_index {bad} is outside the invoke's batch of {size} prompt(s) (valid: 0..{size - 1}); "
            "on vLLM an invoke holds one prompt"
        )
    return [row % size for row in rows]


#: The position forms of a declarative steering spec that name a phase of the sequence.
PHASES = ("all", "prompt", "generated")


def phase_or_positions(chosen: Any, what: str, phases: Sequence[str] = PHASES) -> str | list[int]:
    """``chosen`` as a spec's positions: one of ``phases`` (a steering spec's `PHASES` unless told) or a non-empty
    list of prompt positions."""
    if isinstance(chosen, str) and chosen in phases:
        return chosen
    listed = listed_ints(chosen)
    if listed is not None:
        return listed
    named = ", ".join(repr(phase) for phase in phases)
    raise ValueError(
        f"{what}: positions must be one of {named} or a non-empty list of prompt positions "
        f"(ints, negative counting from the prompt's end), got {chosen!r}"
    )


PROMPT_FORMS = "a string, a list of token ids, an integer tensor of token ids, or a tokenizer's output (input_ids)"


def _token_ids(ids: Any, vocab_size: int, what: str) -> None:
    """Refuse token ids that are empty, not ints, or outside the vocabulary."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"{what}: token ids must be an integer tensor, got {ids.dtype}")
        if ids.dim() not in (1, 2) or ids.numel() == 0:
            raise ValueError(
                f"{what}: a tensor of token ids must be non-empty [seq] or [batch, seq], got {list(ids.shape)}"
            )
        flat = ids.flatten().tolist()
    else:
        flat = list(ids)
        if not flat:
            raise ValueError(f"{what}: the prompt is empty; give at least one token")
    bad = sorted({i for i in flat if not 0 <= i < vocab_size})
    if bad:
        raise ValueError(
            f"{what}: token id(s) {bad[:8]}{' ...' if len(bad) > 8 else ''} are outside the vocabulary "
            f"(vocab_size={vocab_size}: ids 0..{vocab_size - 1})"
        )


def prompt(value: Any, vocab_size: int, what: str, batched: bool) -> None:
    """Refuse an input that is not a prompt (or, where ``batched``, a batch of prompts), naming what is accepted.

    Accepted: a non-empty string, a list of token ids, an integer tensor of ids, a mapping holding
    ``input_ids`` (a tokenizer's output) or the engine's own prompt form (a mapping without them),
    and where ``batched`` a list of strings or of token-id lists. Token ids must lie in the vocabulary.
    """
    forms = PROMPT_FORMS + (", or a list of such prompts" if batched else "")
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{what}: the prompt is an empty string; give at least one character or token")
        return
    if isinstance(value, torch.Tensor):
        _token_ids(value, vocab_size, what)
        return
    if isinstance(value, Mapping):
        ids = value.get("input_ids", value.get("prompt_token_ids"))
        if ids is not None:
            for row in ids if isinstance(ids, list) and ids and isinstance(ids[0], list) else [ids]:
                _token_ids(row, vocab_size, what)
        return
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{what}: the prompt is an empty list; give {forms}")
        if all(is_int(item) for item in value):
            _token_ids(value, vocab_size, what)
            return
        if all(isinstance(item, Mapping) for item in value):  # chat messages
            return
        if batched and all(isinstance(item, str) for item in value):
            for item in value:
                prompt(item, vocab_size, what, batched=False)
            return
        if batched and all(isinstance(item, (list, tuple)) for item in value):
            for item in value:
                if not all(is_int(i) for i in item):
                    raise TypeError(f"{what}: a batch of token-id lists holds a non-int id in {list(item)[:8]!r}")
                _token_ids(item, vocab_size, what)
            return
        kinds = "/".join(sorted({type(item).__name__ for item in value}))
        raise TypeError(f"{what}: the prompt is a list of {kinds} items; give {forms}")
    raise TypeError(f"{what}: the prompt is of type {type(value).__name__} ({value!r:.40}); give {forms}")


def prompt_length(tokens: int, limit: int | None, what: str) -> None:
    """Refuse a prompt longer than the model takes (``limit``, its config's maximum positions)."""
    if limit is not None and tokens > limit:
        raise ValueError(
            f"{what}: the prompt has {tokens} tokens, more than the model's maximum of {limit} positions "
            "(max_position_embeddings); shorten or split it"
        )
