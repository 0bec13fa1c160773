"""Every error the library raises on purpose, in one place."""

from __future__ import annotations


class UnsupportedFamily(Exception):
    """A model the library cannot serve: no family module for it, or the default family refuses it."""


class UnavailableValue(RuntimeError):
    """A standardized value this model (or this engine) does not have.

    Raised when the value is read or written, before the model runs; the message
    names the value, the family and the reason. ``model.support()`` lists the same
    reasons without raising.
    """


class EngineShutDown(RuntimeError):
    """A call on a vLLM engine after its ``shutdown()``: the message names the engine and what to do instead."""
