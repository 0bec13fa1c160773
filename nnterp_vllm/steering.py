"""`Steering`: a declarative steering spec, checked on the client, carried per request into the engine.

A spec says what `Standardized.steer` says (a vector added to the residual stream leaving some
standardized blocks, times a factor) plus *when*, so one request can carry it through a whole
generation: ``positions="all"`` (every token, prompt and generated), ``"prompt"``, ``"generated"``
(each generated token, when it is fed back in), or a list of prompt positions (negative counting from
the prompt's end). A request may carry several specs; they add.

The spec is checked twice, with the errors `steer` raises: what needs no model when it is made
(types, dtype, finiteness, the position form), the rest against the engine's model and the rendered
prompt (vector width, layer range, positions inside the prompt) before the request is sent.
What travels to the engine is `request_steering`'s plain form (lists and numbers, so vLLM's
serializer carries it in ``SamplingParams.extra_args``); `token_sets` reads it on both sides.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import arguments

WHAT = "Steering"
#: The key of ``SamplingParams.extra_args`` under which a request's steering travels to the engine.
EXTRA_ARGS_KEY = "nnterp_vllm_steering"


@dataclass(frozen=True, eq=False)
class Steering:
    """Add ``factor * vector`` to the residual stream leaving ``layers``, at ``positions``.

    Args:
        layers: A standardized block index or a list of them (``layers=10`` is ``model.layers[10]``;
            negative counts from the last block).
        vector: A ``[hidden_size]`` tensor or a list of floats.
        factor: A finite number the vector is multiplied by.
        positions: ``"all"`` (default: prompt and generated tokens), ``"prompt"``, ``"generated"``, or
            a list of prompt positions (negative counting from the prompt's end).

    The checks that need no model run here; the vector's width, the layer range and the positions
    against the prompt are checked when a request carrying the spec is made.
    """

    layers: int | Sequence[int]
    vector: torch.Tensor | Sequence[float] = field(repr=False)
    factor: float = 1.0
    positions: str | Sequence[int] = "all"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", arguments.layer_list(self.layers, WHAT))
        object.__setattr__(self, "vector", arguments.one_vector(self.vector, WHAT).detach())
        object.__setattr__(self, "factor", arguments.finite_number(self.factor, WHAT))
        object.__setattr__(self, "positions", arguments.phase_or_positions(self.positions, WHAT))

    def resolved(self, num_layers: int, hidden_size: int, prompt_length: int) -> dict[str, Any]:
        """This spec in its engine form for a prompt of ``prompt_length`` tokens on a model of ``num_layers``
        blocks of width ``hidden_size``: sorted layer indices, the vector as float32 numbers, the factor, the
        phase or sorted absolute prompt positions. Raises `ValueError` as `steer` does."""
        layers = arguments.layer_indices(self.layers, num_layers, WHAT)
        vector = arguments.hidden_vector(self.vector, hidden_size, WHAT, rows=False)
        positions = self.positions
        if not isinstance(positions, str):
            positions = sorted(set(arguments.positions_within(positions, prompt_length, WHAT)))
        return {
            "layers": layers,
            "vector": vector.to(device="cpu", dtype=torch.float32).tolist(),
            "factor": self.factor,
            "positions": positions,
        }


def specs_of(steering: Any) -> list[Steering]:
    """One request's steering (``None``, a `Steering`, or a list of them) as a list of specs."""
    if steering is None:
        return []
    if isinstance(steering, Steering):
        return [steering]
    if isinstance(steering, (list, tuple)) and all(isinstance(spec, Steering) for spec in steering):
        return list(steering)
    raise TypeError(
        f"{WHAT}: a request's steering is None, a Steering or a list of Steering, got {type(steering).__name__}"
    )


def per_prompt(steering: Any, count: int) -> list[list[Steering]]:
    """``steering`` as given to ``generate`` for ``count`` prompts: one list of specs per prompt.

    A list as long as the prompts holds one entry per prompt (``None``, a `Steering` or a list of them);
    anything else (``None``, one `Steering`, another list of them) is for every prompt.
    """
    if isinstance(steering, (list, tuple)) and len(steering) == count:
        return [specs_of(entry) for entry in steering]
    return [specs_of(steering)] * count


def request_steering(
    specs: Sequence[Steering], num_layers: int, hidden_size: int, prompt_length: int, rows_per_request: int
) -> tuple[dict[str, Any], str] | None:
    """A request's steering in engine form and the cache salt keying its prefix-cache blocks; ``None`` unsteered.

    The engine form is ``{"prompt_tokens": n, "specs": [...], "digests": [...]}``, a digest per spec
    (its layers, vector and factor: specs with the same digest add the same thing). The salt digests
    all of it, the prompt's length included where a phase depends on it, so two requests share cached
    blocks only when every token of the shared prefix was steered alike.
    """
    if not specs:
        return None
    resolved = [spec.resolved(num_layers, hidden_size, prompt_length) for spec in specs]
    digests = [_digest(entry["layers"], entry["factor"], entry["vector"]) for entry in resolved]
    steering = {"prompt_tokens": prompt_length, "specs": resolved, "digests": digests}
    needed = token_sets(steering).count()
    if needed > rows_per_request:
        raise ValueError(
            f"{WHAT}: these {len(specs)} specs act on {needed} distinct combinations of tokens (prompt, generated, "
            f"listed positions), each a row of the engine's steering table; the engine holds {rows_per_request} "
            "per request (SteeredVLLM(..., steering_rows_per_request=N) holds more)"
        )
    phases = [entry["positions"] for entry in resolved]
    length = prompt_length if any(phase in ("prompt", "generated") for phase in phases) else None
    salt = hashlib.sha256(json.dumps([digests, phases, length]).encode()).hexdigest()
    return steering, f"nnterp_vllm-steering-{salt}"


def _digest(layers: list[int], factor: float, vector: list[float]) -> str:
    packed = struct.pack(f"<{len(vector)}f", *vector)
    return hashlib.sha256(json.dumps([layers, factor]).encode() + packed).hexdigest()


@dataclass(frozen=True)
class TokenSets:
    """Which specs of a request act on which of its tokens: each a tuple of spec indices (empty: none)."""

    prompt_length: int
    #: On a prompt token no listed position names.
    prompt: tuple[int, ...]
    #: On a generated token.
    generated: tuple[int, ...]
    #: On a prompt position some spec lists, by position.
    listed: dict[int, tuple[int, ...]]

    def count(self) -> int:
        """How many distinct non-empty sets of specs act on some token."""
        return len({tokens for tokens in (self.prompt, self.generated, *self.listed.values()) if tokens})


def token_sets(steering: dict[str, Any]) -> TokenSets:
    """The `TokenSets` of a request's steering in engine form."""
    phases = [spec["positions"] for spec in steering["specs"]]
    prompt = tuple(i for i, phase in enumerate(phases) if phase in ("all", "prompt"))
    generated = tuple(i for i, phase in enumerate(phases) if phase in ("all", "generated"))
    listed: dict[int, tuple[int, ...]] = {}
    for i, phase in enumerate(phases):
        if not isinstance(phase, str):
            for position in phase:
                listed[position] = listed.get(position, prompt) + (i,)
    return TokenSets(steering["prompt_tokens"], prompt, generated, listed)


__all__ = ["EXTRA_ARGS_KEY", "Steering", "TokenSets", "per_prompt", "request_steering", "specs_of", "token_sets"]
