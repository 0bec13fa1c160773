"""The vectors a client registers by name (``POST /v1/steering/vectors``) and those the server starts with
(``--steering-vectors``), read with errors that name the field."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .. import arguments
from .errors import InvalidField, naming
from .intake import decode_json
from .registry import Vector
from .steering_field import checked_vector

#: What a registered vector's name may be (it is also a URL path segment).
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
NAME_RULE = "1 to 128 letters, digits, '.', '_', ':' or '-', starting with a letter or digit"


def checked_name(name: Any) -> str:
    """``name`` checked as a registered vector's name; raises ``ValueError``."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"a vector's name is {NAME_RULE}, got {name!r}")
    return name


def read_registration(body: bytes, hidden_size: int) -> tuple[str, Vector]:
    """A ``POST /v1/steering/vectors`` body ``{"name", "vector"}``: the name and the float32 vector; a vector made
    per layer is an object from layer numbers to vectors (``{"10": [...], "11": [...]}``).

    Raises `InvalidField`. Meant to run off the event loop: it parses and checks every number.
    """
    try:
        parsed = decode_json(body)
    except ValueError as error:
        raise InvalidField(f"the body is not JSON: {error}", None) from None
    if not isinstance(parsed, dict):
        raise InvalidField(f"the body is an object {{'name', 'vector'}}, got {type(parsed).__name__}", None)
    for key in parsed:
        if key not in ("name", "vector"):
            raise InvalidField(f"unknown field {key!r}; a vector is registered with 'name' and 'vector'", key)
    with naming("name"):
        name = checked_name(parsed.get("name"))
    vector = parsed.get("vector")
    if isinstance(vector, dict):
        return name, per_layer(vector, hidden_size)
    with naming("vector"):
        return name, checked_vector(vector, hidden_size, "vector").to(torch.float32)


def per_layer(vectors: dict[str, Any], hidden_size: int) -> dict[int, torch.Tensor]:
    """A registration's per-layer vectors (``{"<layer>": [floats]}``), each checked; raises `InvalidField`."""
    if not vectors:
        raise InvalidField("vector: a vector made per layer maps at least one layer to a vector", "vector")
    checked = {}
    for layer, vector in vectors.items():
        where = f"vector.{layer}"
        if not (isinstance(layer, str) and re.fullmatch(r"-?\d+", layer)):
            raise InvalidField(f"{where}: a vector made per layer is keyed by layer numbers, got {layer!r}", where)
        with naming(where):
            checked[int(layer)] = checked_vector(vector, hidden_size, where).to(torch.float32)
    return checked


def read_vector_sources(sources: Sequence[str], hidden_size: int, capacity: int) -> dict[str, Vector]:
    """``--steering-vectors``' entries, read and checked; raises ``ValueError`` naming the bad one.

    An entry is a safetensors file of named ``[hidden_size]`` vectors (each registered under its name), or
    ``[NAME=]SOURCE[#FEATURE]``: a vector made elsewhere as `load_steering` reads it (a repeng ``.gguf``, a
    steering-vectors dict saved with ``torch.save`` or as safetensors, a SAELens directory with the feature),
    registered per layer under ``NAME`` (the file's name without its suffix by default).
    """
    from ..steering.sources import read_vectors

    vectors: dict[str, Vector] = {}
    for entry in sources:
        name, _, source = entry.rpartition("=") if "=" in entry else ("", "", entry)
        source, _, feature = source.partition("#")
        try:
            named = _named_vectors_file(source)
            if named is None:
                read = read_vectors(source, int(feature) if feature else None)
                named = {checked_name(name or Path(source).stem): read}
            elif name or feature:
                raise ValueError(
                    f"{source} holds named vectors, registered under their own names: drop NAME= / #FEATURE"
                )
            for key, vector in named.items():
                for one in vector.values() if isinstance(vector, dict) else [vector]:
                    arguments.hidden_vector(one, hidden_size, f"vector {key!r}", rows=False)
                if key in vectors:
                    raise ValueError(f"two entries register {key!r}")
                vectors[key] = vector
        except (ValueError, TypeError) as error:
            raise ValueError(f"--steering-vectors {entry}: {error}") from None
    if len(vectors) > capacity:
        raise ValueError(
            f"--steering-vectors: {len(vectors)} vectors, more than the registry holds "
            f"(--max-steering-vectors {capacity}); raise --max-steering-vectors or register fewer"
        )
    return vectors


def _named_vectors_file(source: str) -> dict[str, torch.Tensor] | None:
    """A safetensors file of named vectors (none named ``layer_activations.<layer>``, which is steering-vectors'
    format), float32, each name checked; ``None`` for any other source."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not Path(source).is_file():
        return None
    try:
        tensors = load_file(source)
    except (OSError, SafetensorError):
        return None
    if any(re.fullmatch(r"layer_activations\.-?\d+", name) for name in tensors):
        return None
    for name in tensors:
        checked_name(name)
    return {name: tensor.to(torch.float32) for name, tensor in tensors.items()}
