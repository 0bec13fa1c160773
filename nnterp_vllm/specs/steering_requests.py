"""A request's steering: the specs it carries (`specs_of`, `per_prompt`) and their engine form.

What travels to the engine is `request_steering`'s plain form (lists and numbers, so vLLM's
serializer carries it in ``SamplingParams.extra_args``); `token_sets` reads it on both sides.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .patch import Patch
from .steering import EVERYWHERE, WHAT, Ablate, Cap, Clamp, Steering

#: Caps, ablations and clamps one token may have applied at one block (the engine's direction slots per table row),
#: unless the engine is built with another number (``SteeredVLLM(..., steering_directions_per_block=N)``).
DIRECTIONS_PER_BLOCK = 2
#: The key of ``SamplingParams.extra_args`` under which a request's steering travels to the engine.
EXTRA_ARGS_KEY = "nnterp_vllm_steering"
#: The key of a request's steering (engine form) naming the first prompt position it changes and the salt its
#: prefix-cache blocks take from the block holding that position on (`request_steering`).
SALTED_FROM = "salted_from"

#: The specs a request may carry.
SPECS = (Steering, Cap, Clamp, Patch)
#: Each kind of spec by the name a server request or a grid file gives it: the spec and the fields of its own it
#: takes (beside ``positions``, and a direction's ``layers`` and ``vector``, which every kind but a clamp takes).
KINDS: dict[str, tuple[type, tuple[str, ...]]] = {
    "add": (Steering, ("factor", "scale")),
    "ablate": (Ablate, ()),
    "cap": (Cap, ("min", "max")),
    "clamp": (Clamp, ("sae", "feature", "value", "scale")),
    "patch": (Patch, ("vectors", "value")),
}


def kind_fields(kind: str) -> tuple[str, ...]:
    """The fields a spec of ``kind`` (`KINDS`) takes beside ``positions``: a direction's ``vector`` and ``layers``
    (but a clamp's direction is its SAE feature's) and its own."""
    own = KINDS[kind][1]
    if kind == "clamp":
        return own
    return ("layers", *own) if kind == "patch" else ("vector", "layers", *own)


def is_relative(entry: dict[str, Any]) -> bool:
    """Whether a spec in engine form adds a fraction of the stream's norm (a relative `Steering`)."""
    return entry.get("scale") == "relative"


def specs_of(steering: Any, where: str = "steering") -> list[Steering | Cap]:
    """One request's steering (``None``, a spec, or a list of them) as a list of specs (`Steering`, `Cap`,
    `Ablate`).

    A wrong type raises ``TypeError`` naming ``where`` (and the bad element's index in a list).
    """
    if steering is None:
        return []
    if isinstance(steering, SPECS):
        return [steering]
    if isinstance(steering, (list, tuple)):
        for index, spec in enumerate(steering):
            if not isinstance(spec, SPECS):
                raise TypeError(
                    f"{WHAT}: {where}[{index}] is a {type(spec).__name__}; a request's steering is None, a Steering "
                    "(or Cap, Ablate, Clamp, Patch) or a list of them"
                )
        return list(steering)
    raise TypeError(
        f"{WHAT}: {where} is a {type(steering).__name__}; a request's steering is None, a Steering (or Cap, Ablate, "
        "Clamp, Patch) or a list of them"
    )


def per_prompt(steering: Any, count: int) -> list[list[Steering | Cap]]:
    """``steering`` as given to ``generate`` for ``count`` prompts: one list of specs per prompt.

    A list as long as the prompts holds one entry per prompt (``None``, a spec or a list of them);
    anything else (``None``, one spec, a list of specs of another length) is for every prompt.
    A list of another length holding anything but specs fits neither reading: ``TypeError`` naming both.
    """
    if isinstance(steering, (list, tuple)) and len(steering) == count:
        return [specs_of(entry, f"steering[{index}]") for index, entry in enumerate(steering)]
    if isinstance(steering, (list, tuple)) and not all(isinstance(spec, SPECS) for spec in steering):
        raise TypeError(
            f"{WHAT}: steering is a list of {len(steering)} entries for {count} prompt(s), not all of them specs. "
            f"Give one entry per prompt (a list of {count}, each None, a Steering (or Cap, Ablate, Clamp, Patch) or a "
            "list of them), or one spec or a list of specs (of any length) that steers every prompt with all of them"
        )
    return [specs_of(steering)] * count


def request_steering(
    specs: Sequence[Steering],
    num_layers: int,
    hidden_size: int,
    prompt_length: int,
    dtype: torch.dtype = torch.float32,
    directions_per_block: int = DIRECTIONS_PER_BLOCK,
) -> tuple[dict[str, Any], str | None] | None:
    """A request's steering in engine form and the cache salt keying its prefix-cache blocks; ``None`` unsteered.

    The engine form is ``{"prompt_tokens": n, "specs": [...], "digests": [...]}``, a digest per spec
    (its kind, layers, vector and factor or bounds: specs with the same digest do the same thing). The salt digests
    all of it, the prompt's length included where a phase depends on it, so two requests share cached
    blocks only when every token of the shared prefix was steered alike. Steering of generated tokens
    only (`decode_only`) leaves the prompt's KV as an unsteered request computes it: no salt, so its
    prompt blocks are shared (and the engine caches none of its generated ones). Steering that acts on listed
    prompt positions only, the first of them ``p > 0``, leaves every token before ``p`` as an unsteered request
    computes it: the engine form then carries the salt and ``p`` (`SALTED_FROM`), no cache salt is returned, and
    the engine's scheduler salts the prompt's blocks from the one holding ``p`` on, so the blocks before it are
    shared with unsteered requests and any other steered from ``p`` or later. Steering a model computing in
    ``dtype`` could not hold (`check_held`), or more directions on one token at one block than the engine's
    ``directions_per_block`` (`check_directions`), is refused.
    """
    if not specs:
        return None
    resolved = [entry for spec in specs for entry in listed(spec.resolved(num_layers, hidden_size, prompt_length))]
    check_held(resolved, dtype)
    check_patches(resolved)
    digests = [_digest(entry) for entry in resolved]
    steering = {"prompt_tokens": prompt_length, "specs": resolved, "digests": digests}
    check_directions(resolved, token_sets(steering), directions_per_block)
    phases = [entry["positions"] for entry in resolved]
    if decode_only(steering):
        return steering, None
    length = prompt_length if any(phase in ("prompt", "generated") for phase in phases) else None
    salt = f"nnterp_vllm-steering-{hashlib.sha256(json.dumps([digests, phases, length]).encode()).hexdigest()}"
    first = min((min(phase) for phase in phases if not isinstance(phase, str)), default=0)
    if first > 0 and all(not isinstance(phase, str) or phase == "generated" for phase in phases):
        steering[SALTED_FROM] = [first, salt]
        return steering, None
    return steering, salt


def listed(resolved: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A spec's engine form as a list of entries (a `Patch` makes one per position)."""
    return resolved if isinstance(resolved, list) else [resolved]


#: The kinds of spec that move the stream along a direction (each takes a direction slot of the engine's pool entry).
DIRECTION_KINDS = ("cap", "clamp")


def takes_direction(entry: dict[str, Any]) -> bool:
    """Whether a spec in engine form takes a direction slot whatever acts beside it: a cap or clamp, or a gated
    addition (which moves the stream by its vector only where its gate passes)."""
    return entry["kind"] in DIRECTION_KINDS or entry.get("when") is not None


def slotted(entries: Sequence[dict[str, Any]]) -> list[bool]:
    """Which of the specs (engine form) one pool entry applies at one location take a direction slot: those that
    `takes_direction`, and the ungated relative additions where an ungated absolute addition or a patch acts there
    too. The entry's own added vector is then the absolute ones' sum (or the patch), else the relative ones' sum,
    times the stream's norm: one vector, one scale."""
    first = [entry["kind"] in ("add", "patch") and not takes_direction(entry) for entry in entries]
    mixed = any(own and not is_relative(entry) for own, entry in zip(first, entries))
    return [not own or (mixed and is_relative(entry)) for own, entry in zip(first, entries)]


def check_patches(resolved: Sequence[dict[str, Any]]) -> None:
    """Refuse two patch entries that set the same value of the same block at the same position; ``ValueError``."""
    seen: dict[tuple, int] = {}
    for i, entry in enumerate(resolved):
        if entry["kind"] != "patch":
            continue
        for layer in entry["layers"]:
            key = (entry["value"], layer, entry["positions"][0])
            if key in seen:
                raise ValueError(
                    f"Patch: specs {[seen[key], i]} both set layers.{layer}.{entry['value']} at position {key[2]}; "
                    "a value is set once per position"
                )
            seen[key] = i


def decode_only(steering: dict[str, Any]) -> bool:
    """Whether a request's steering (engine form) acts on generated tokens only, none of its prompt."""
    return all(spec["positions"] == "generated" for spec in steering["specs"])


#: The vector added at a layer may reach at most the model dtype's largest finite value over this.
HEADROOM = 16


def held_bound(dtype: torch.dtype) -> float:
    """The largest magnitude an element of the vector added at one layer may have in a model computing in
    ``dtype``: its largest finite value over `HEADROOM`, so the stream it is added to keeps room to grow."""
    return torch.finfo(dtype).max / HEADROOM


def check_held(resolved: Sequence[dict[str, Any]], dtype: torch.dtype) -> None:
    """Refuse specs in engine form (`Steering.resolved`) whose added vector at some layer (``factor * vector``
    summed over the specs at that layer) has an element above `held_bound` of ``dtype``; ``ValueError``. A relative
    addition is left out: its size is a fraction of the stream's own norm, which only the engine knows."""
    bound = held_bound(dtype)
    added: dict[int, torch.Tensor] = {}
    adders: dict[int, list[int]] = {}
    for i, entry in enumerate(resolved):
        if entry["kind"] not in ("add", "patch") or is_relative(entry):
            continue
        scaled = torch.tensor(entry["vector"], dtype=torch.float64) * entry.get("factor", 1.0)
        for layer in entry["layers"]:
            added[layer] = added[layer] + scaled if layer in added else scaled
            adders.setdefault(layer, []).append(i)
    for layer in sorted(added):
        magnitude = added[layer].abs().nan_to_num(nan=math.inf)
        element = int(magnitude.argmax())
        if magnitude[element] > bound:
            held = str(dtype).removeprefix("torch.")
            raise ValueError(
                f"{WHAT}: at layer {layer} the added vector (factor x vector, summed over spec(s) {adders[layer]}) "
                f"reaches {float(added[layer][element]):.3g} at element {element}; a model computing in {held} holds "
                f"it with room to spare only within +-{bound:.3g} ({held}'s largest finite value "
                f"{torch.finfo(dtype).max:.3g} / {HEADROOM}): lower the factor or the vector"
            )


def check_directions(
    resolved: Sequence[dict[str, Any]], sets: TokenSets, directions_per_block: int = DIRECTIONS_PER_BLOCK
) -> None:
    """Refuse specs in engine form that would cap, ablate or clamp more than ``directions_per_block`` directions on
    one token at one block (the engine's direction slots per row); ``ValueError`` naming the block and the specs."""
    for indices in {tokens for tokens in (sets.prompt, sets.generated, *sets.listed.values()) if tokens}:
        per_layer: dict[Any, list[int]] = {}
        for i in indices:
            if resolved[i].get("value", "layer_output") == "layer_output":  # a patch elsewhere shares no entry
                layers = resolved[i]["layers"]
                for layer in [layers] if layers == EVERYWHERE else layers:
                    per_layer.setdefault(layer, []).append(i)
        for layer, acting in per_layer.items():
            capping = [i for i, slot in zip(acting, slotted([resolved[i] for i in acting])) if slot]
            if len(capping) > directions_per_block:
                where = "at every location (layers='all')" if layer == EVERYWHERE else f"at layer {layer}"
                added = [i for i in capping if resolved[i]["kind"] == "add"]
                adds = (
                    f" (additions {added} take a slot each: gated, or relative beside an absolute one or a patch)"
                    if added
                    else ""
                )
                raise ValueError(
                    f"{WHAT}: specs {capping} cap, ablate or clamp {len(capping)} directions on the same tokens "
                    f"{where}{adds}; the engine applies at most {directions_per_block} per token there (an engine "
                    "built with SteeredVLLM(..., steering_directions_per_block=N) applies N): ablate their span in "
                    "fewer directions, or spread them over blocks or positions"
                )


def _digest(entry: dict[str, Any]) -> str:
    """What a spec in engine form does, hashed: everything but its positions."""
    vectors = [value for key, value in sorted(entry.items()) if key in ("vector", "write")]
    what = [[key, value] for key, value in sorted(entry.items()) if key not in ("vector", "write", "positions")]
    packed = b"".join(struct.pack(f"<{len(vector)}f", *vector) for vector in vectors)
    return hashlib.sha256(json.dumps(what).encode() + packed).hexdigest()


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


__all__ = [
    "DIRECTIONS_PER_BLOCK",
    "EXTRA_ARGS_KEY",
    "HEADROOM",
    "KINDS",
    "TokenSets",
    "decode_only",
    "is_relative",
    "kind_fields",
    "per_prompt",
    "request_steering",
    "slotted",
    "specs_of",
    "token_sets",
]
