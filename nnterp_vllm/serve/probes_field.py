"""A request's ``probes`` field and the probes that gate steering specs, read with errors that name the field."""

from __future__ import annotations

from typing import Any

from ..specs.probes import Probe
from .errors import InvalidField, naming

#: The fields of one probe of a request's ``probes`` field.
PROBE_FIELDS = ("weight", "bias", "layer", "positions", "activation")


def read_probe(probe: Any, where: str, hidden_size: int) -> Probe:
    """One probe of a request body (``{"weight", "bias", "layer", "positions", "activation"}``, its weight a list of
    floats or one list per class... as ``[hidden]`` or ``[hidden][classes]``) as a `Probe`; `InvalidField`."""
    if not isinstance(probe, dict):
        raise InvalidField(f"{where}: a probe is an object {{{', '.join(PROBE_FIELDS)}}}", where)
    for name in probe:
        if name not in PROBE_FIELDS:
            raise InvalidField(
                f"{where}: unknown field {name!r}; a probe has {', '.join(PROBE_FIELDS)}", f"{where}.{name}"
            )
    for name in ("weight", "layer"):
        if name not in probe:
            raise InvalidField(f"{where}: the field {name!r} is required", f"{where}.{name}")
    with naming(f"{where}.weight"):
        made = Probe(
            probe["weight"],
            probe.get("bias", 0.0),
            probe["layer"],
            probe.get("positions", "all"),
            probe.get("activation"),
        )
        if made.weight.shape[0] != hidden_size:
            raise ValueError(f"{where}: weight is {made.weight.shape[0]} wide; this model's stream is {hidden_size}")
    return made


def read_probes(probes: Any, hidden_size: int) -> dict[str, Probe] | None:
    """A request's ``probes`` field (``None``, or an object from names to probes, `read_probe`); `InvalidField`."""
    if probes is None:
        return None
    if not isinstance(probes, dict) or not probes:
        raise InvalidField("probes is a non-empty object from names to probes {'weight', 'layer', ...}", "probes")
    return {name: read_probe(probe, f"probes.{name}", hidden_size) for name, probe in probes.items()}
