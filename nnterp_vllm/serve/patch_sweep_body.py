"""A ``POST /v1/patch_sweep`` body and the metrics it names, read with errors that name the field."""

from __future__ import annotations

from typing import Any

from ..specs.metrics import LogitDiff, Logprob, Recovered
from .errors import InvalidField
from .intake import decode_json

#: The fields of a ``POST /v1/patch_sweep`` body.
PATCH_SWEEP_FIELDS = ("clean", "corrupt", "layers", "positions", "metric", "value")


def read_patch_sweep(body: bytes) -> dict[str, Any]:
    """A ``POST /v1/patch_sweep`` body: ``clean`` and ``corrupt`` prompts (text or token ids), optional ``layers``,
    ``positions`` and ``value``, and a ``metric`` (``{"kind": "logit_diff", "correct", "wrong"}``, ``{"kind":
    "logprob", "token"}`` or ``{"kind": "recovered", "of": <one of those>}``), as `patch_sweep`'s arguments; what
    needs the model is checked there. Raises `InvalidField` naming the field."""
    try:
        parsed = decode_json(body)
    except ValueError as error:
        raise InvalidField(f"the body is not JSON: {error}", None) from None
    if not isinstance(parsed, dict):
        raise InvalidField(
            f"the body is an object {{{', '.join(PATCH_SWEEP_FIELDS)}}}, got {type(parsed).__name__}", None
        )
    for name in parsed:
        if name not in PATCH_SWEEP_FIELDS:
            raise InvalidField(f"unknown field {name!r}; a patch sweep takes {', '.join(PATCH_SWEEP_FIELDS)}", name)
    for name in ("clean", "corrupt", "metric"):
        if name not in parsed:
            raise InvalidField(f"the field {name!r} is required", name)
    return {**parsed, "metric": read_metric(parsed["metric"], "metric")}


def read_metric(metric: Any, where: str) -> LogitDiff | Logprob | Recovered:
    """A metric object of a request body as `specs.metrics`' spec; `InvalidField` naming the field."""
    kinds = {"logit_diff": ("correct", "wrong"), "logprob": ("token",), "recovered": ("of",)}
    kind = metric.get("kind") if isinstance(metric, dict) else None
    if kind not in kinds:
        raise InvalidField(
            f"{where}: a metric is an object whose kind is one of {', '.join(kinds)} (logit_diff: correct, wrong; "
            f"logprob: token; recovered: of, another metric), got {metric!r}",
            f"{where}.kind",
        )
    for name in metric:
        if name not in (*kinds[kind], "kind"):
            raise InvalidField(
                f"{where}: a {kind} metric takes {', '.join(kinds[kind])}, not {name!r}", f"{where}.{name}"
            )
    for name in kinds[kind]:
        if name not in metric:
            raise InvalidField(f"{where}: a {kind} metric needs {name!r}", f"{where}.{name}")
    if kind == "recovered":
        measured = read_metric(metric["of"], f"{where}.of")
        if isinstance(measured, Recovered):
            raise InvalidField(f"{where}.of: recovered measures a logit_diff or logprob metric", f"{where}.of")
        return Recovered(measured)
    return LogitDiff(metric["correct"], metric["wrong"]) if kind == "logit_diff" else Logprob(metric["token"])
