"""Every error the library raises on purpose, in one place, and the warnings it gives where a mistake runs on."""

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


class TraceNeverRan(UserWarning):
    """A trace (or an invoke) built and discarded without having run: written without ``with``, it runs nothing.

    Given once per line that built one; the message names that line.
    """


class ParameterWritten(UserWarning):
    """A model parameter written in a trace: the change stays for every later trace and generation of the model.

    Given once per parameter per model; the message says how to undo the write, or how to make one that lasts a
    single trace.
    """


class UnsafeAnswer(ValueError):
    """A trace server's answer that names something the client does not load (loading it could run code), or that is
    not in ``torch.save``'s format: refused before any of it is built; the message names what it holds."""


class SavedTooMuch(ValueError):
    """A trace sent to a server saved more than the server hands back (``--max-saved-bytes``): the engine stopped it
    at the step that passed the bound; the server answers 413."""
