"""A request's ``capture`` field, checked against the values the engine keeps, with errors that name the field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..components.names import SAE_FEATURES
from ..specs.capture import TOP_K, Capture
from .errors import InvalidField, naming


def read_capture(
    capture: Any, num_layers: int, kept: Sequence[str], saes: Sequence[dict[str, Any]] = ()
) -> Capture | None:
    """A request's ``capture`` field (``None``, or ``{"values", "positions", "dtype", "top_k", "features"}`` as
    `Capture` takes them), checked against the values the engine keeps and the SAEs it holds (``saes``: each
    ``{"name", "layer", "d_sae", ...}``); raises `InvalidField` naming the field."""
    if capture is None:
        return None
    if not kept:
        raise InvalidField(
            "capture: this server keeps no values; start it with --capture-values naming those requests may capture",
            "capture",
        )
    if not isinstance(capture, dict):
        raise InvalidField(
            f"capture is an object {{'values', 'positions', 'dtype'}}, got {type(capture).__name__}", "capture"
        )
    for key in capture:
        if key not in CAPTURE_FIELDS:
            raise InvalidField(
                f"capture: unknown field {key!r}; a capture has {', '.join(CAPTURE_FIELDS)}", f"capture.{key}"
            )
    if "values" not in capture:
        raise InvalidField("capture: the field 'values' is required", "capture.values")
    with naming("capture.values"):
        spec = Capture(capture["values"])
        names = spec.names(num_layers)
        for name in names:
            if name.endswith(f".{SAE_FEATURES}"):
                Capture(name).resolved(num_layers, kept, 1, torch.float32, saes)  # the SAE held, its rows kept
    missing = [name for name in names if name not in kept and not name.endswith(f".{SAE_FEATURES}")]
    if missing:
        raise InvalidField(
            f"capture: this server keeps no {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}; it keeps "
            f"{', '.join(kept)} (--capture-values)",
            "capture.values",
        )
    with naming("capture.positions"):
        spec = Capture(spec.values, capture.get("positions", "all"))
    with naming("capture.dtype"):
        spec = Capture(spec.values, spec.positions, capture.get("dtype"))
    with naming("capture.top_k"):
        spec = Capture(spec.values, spec.positions, spec.dtype, capture.get("top_k", TOP_K))
    with naming("capture.features"):
        spec = Capture(spec.values, spec.positions, spec.dtype, spec.top_k, capture.get("features"))
        for name in names:
            if name.endswith(f".{SAE_FEATURES}") and spec.features is not None:
                Capture(name, features=spec.features).resolved(num_layers, kept, 1, torch.float32, saes)
    return spec


#: The fields of a request's ``capture``.
CAPTURE_FIELDS = ("values", "positions", "dtype", "top_k", "features")
#: Bytes of kept rows one request may ask for unless the server is told otherwise (--max-capture-bytes).
MAX_CAPTURE_BYTES = 8 * 2**20
