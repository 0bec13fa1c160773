"""What a client sends: a request's ``steering`` field and registered vectors, read with errors that name the field.

Every check is one of `nnterp_vllm.arguments`' (the ones `Steering` and ``steer`` run), called per field
so a refusal names the field it is about (``param``, as in OpenAI's error format: ``steering[1].vector``).
Nothing here needs vLLM: the model's sizes come in as numbers.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import arguments
from ..steering import Steering

#: The fields of one steering spec, in the order they are checked.
SPEC_FIELDS = ("layers", "vector", "factor", "positions")
#: What a registered vector's name may be (it is also a URL path segment).
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
NAME_RULE = "1 to 128 letters, digits, '.', '_', ':' or '-', starting with a letter or digit"


class InvalidField(ValueError):
    """A client's bad input: the message says what was wrong and what would be right; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@contextlib.contextmanager
def naming(param: str) -> Iterator[None]:
    """Inside the block, a ``ValueError``/``TypeError`` from a check becomes an `InvalidField` naming ``param``."""
    try:
        yield
    except InvalidField:
        raise
    except (ValueError, TypeError) as error:
        raise InvalidField(str(error), param) from None


def named_vectors(steering: Any) -> set[str]:
    """The registered vector names a ``steering`` field refers to (the field itself is checked by `read_steering`)."""
    if not isinstance(steering, list):
        return set()
    return {spec["vector"] for spec in steering if isinstance(spec, dict) and isinstance(spec.get("vector"), str)}


def read_steering(
    steering: Any, registered: Mapping[str, torch.Tensor], num_layers: int, hidden_size: int
) -> list[Steering]:
    """A request's ``steering`` field (``None``, or a list of spec objects) as `Steering` specs for this model.

    ``registered`` holds at least the vectors the field names (`named_vectors`). Checks every field against
    the model (layer range, vector width); positions are checked against each prompt by `check_positions`.
    Raises `InvalidField`.
    """
    if steering is None:
        return []
    if not isinstance(steering, list):
        raise InvalidField(
            f"steering must be a list of specs, each {{'layers', 'vector', 'factor', 'positions'}}, got "
            f"{type(steering).__name__}",
            "steering",
        )
    return [_read_spec(spec, f"steering[{i}]", registered, num_layers, hidden_size) for i, spec in enumerate(steering)]


def _read_spec(
    spec: Any, where: str, registered: Mapping[str, torch.Tensor], num_layers: int, hidden_size: int
) -> Steering:
    if not isinstance(spec, dict):
        raise InvalidField(
            f"{where}: a steering spec is an object with 'layers', 'vector' and optionally 'factor' and "
            f"'positions', got {type(spec).__name__}",
            where,
        )
    for name in spec:
        if name not in SPEC_FIELDS:
            raise InvalidField(
                f"{where}: unknown field {name!r}; a spec has {', '.join(SPEC_FIELDS)}", f"{where}.{name}"
            )
    for name in ("layers", "vector"):
        if name not in spec:
            raise InvalidField(f"{where}: the field {name!r} is required", f"{where}.{name}")
    factor, positions = spec.get("factor", 1.0), spec.get("positions", "all")
    with naming(f"{where}.layers"):
        arguments.layer_indices(spec["layers"], num_layers, where)
    with naming(f"{where}.vector"):
        vector = _spec_vector(spec["vector"], registered, hidden_size, where)
    with naming(f"{where}.factor"):
        arguments.finite_number(factor, where)
    with naming(f"{where}.positions"):
        arguments.phase_or_positions(positions, where)
    return Steering(spec["layers"], vector, factor, positions)


def _spec_vector(value: Any, registered: Mapping[str, torch.Tensor], hidden_size: int, where: str) -> torch.Tensor:
    if isinstance(value, str):
        if value not in registered:
            raise ValueError(
                f"{where}: no vector is registered as {value!r} (GET /v1/steering/vectors lists them, POST "
                "registers one), or give the vector as a list of floats"
            )
        return registered[value]
    return checked_vector(value, hidden_size, where)


def checked_vector(value: Any, hidden_size: int, what: str) -> torch.Tensor:
    """``value`` (a JSON list of numbers) as a finite float32 ``[hidden_size]`` tensor; raises ``ValueError``."""
    if not isinstance(value, list):
        raise ValueError(
            f"{what}: the vector is a list of {hidden_size} floats or a registered vector's name, "
            f"got {type(value).__name__}"
        )
    return arguments.hidden_vector(arguments.one_vector(value, what), hidden_size, what, rows=False)


def check_positions(specs: Sequence[Steering], prompt_length: int, prompt: str = "the prompt") -> None:
    """Refuse a spec listing a position outside a prompt of ``prompt_length`` tokens (`InvalidField`)."""
    for i, spec in enumerate(specs):
        if not isinstance(spec.positions, str):
            with naming(f"steering[{i}].positions"):
                arguments.positions_within(spec.positions, prompt_length, f"steering[{i}] ({prompt})")


def checked_name(name: Any) -> str:
    """``name`` checked as a registered vector's name; raises ``ValueError``."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"a vector's name is {NAME_RULE}, got {name!r}")
    return name


def read_vectors_file(path: str | Path, hidden_size: int) -> dict[str, torch.Tensor]:
    """A safetensors file of named ``[hidden_size]`` vectors, checked; raises ``ValueError`` naming the bad entry."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as error:
        raise ValueError(f"--steering-vectors {path}: cannot read it as a safetensors file ({error})") from None
    vectors = {}
    for name, tensor in tensors.items():
        try:
            checked_name(name)
            arguments.hidden_vector(tensor, hidden_size, f"vector {name!r}", rows=False)
        except ValueError as error:
            raise ValueError(f"--steering-vectors {path}: {error}") from None
        vectors[name] = tensor.to(torch.float32)
    return vectors
