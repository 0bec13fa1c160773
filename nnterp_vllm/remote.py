"""How a standardized trace travels to where the model is: the model's remote key, and the dry run of sending one.

A trace sent elsewhere (NDIF's ``remote=True``, or its dry run ``remote="local"``) travels in nnsight's own
request format: the block's source, the values it references, and the model object by value with its modules
and interleaver as references the far side resolves against the model it holds. The model's class and the
standardized values on it are imported there by name, so the far side has this library installed.

The key names the class and the checkpoint: ``nnterp_vllm.engines.transformers.StandardizedTransformer:``
followed by nnsight's JSON (``repo_id``, ``revision``, ``task``) for transformers, and
``nnterp_vllm.engines.vllm.StandardizedVLLM:<checkpoint>`` for vLLM. A hub id is keyed as nnsight keys it (the
hub's own spelling of the id, looked up once); a local checkpoint directory by its absolute path, which a
server on the same file system loads as it is.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import packages_distributions
from typing import Any

from nnsight.intervention.backends.local import LocalSimulationBackend

from .errors import UnsafeAnswer

#: The route of a trace server (nnsight-serve's, and ``nnterp-vllm serve --traces``') that a trace is posted to.
TRACE_PATH = "/v1/nnsight/generate"
#: ``extra_args``' key under which nnsight's client sends a request's trace code (one invoke's block) to the engine,
#: and the key of the edits left on the engine that the request runs (nnsight's names).
TRACE_KEY = "nnsight_mediator"
EDITS_KEY = "nnsight_edits"


def checkpoint_key(checkpoint: str) -> str:
    """``checkpoint`` as a model key names it: a local directory by its absolute path, a hub id as it is."""
    expanded = os.path.expanduser(checkpoint)
    return os.path.abspath(expanded) if os.path.isdir(expanded) else checkpoint


class InstalledServerSimulation(LocalSimulationBackend):
    """``remote="local"``: nnsight's dry run of the remote path (serialize, rebuild with the caller's own modules
    hidden, run here), against a server that has this library installed.

    Modules of installed distributions stay importable while the trace is rebuilt, as they are on such a server,
    which imported them once. nnsight's own dry run hides every module outside NDIF's few packages, so rebuilding
    a standardized trace imported this library, vLLM and typing_extensions a second time beside the live ones:
    a second vLLM refuses to import, and a second typing_extensions breaks ``typing`` for the whole process.
    The caller's own modules (scripts, notebooks' helpers) are hidden as before: what a trace uses from them
    must travel with it (nnsight registers them to be sent by value).
    """

    def _hide_local_modules(self) -> dict[str, Any]:
        hidden = super()._hide_local_modules()
        installed = set(packages_distributions())
        for name in [name for name in hidden["modules"] if name.partition(".")[0] in installed]:
            sys.modules[name] = hidden["modules"].pop(name)
        return hidden


#: What a trace server's answer may name besides what ``torch.load(weights_only=True)`` loads (tensors, their
#: storages and dtypes, numbers, strings, bytes, lists, dicts, tuples, sets, ``OrderedDict``): frozen sets, slices,
#: and the output of a request as vLLM makes it, which a trace saves as ``tracer.result``.
ANSWER_GLOBALS = (
    "builtins.frozenset",
    "builtins.slice",
    "vllm.outputs.RequestOutput",
    "vllm.outputs.CompletionOutput",
)


def load_answer(content: bytes) -> dict[str, Any]:
    """A trace server's answer (a ``torch.save`` of ``{"saves", "error", ...}``), loaded without running anything of
    it: every global it names is first checked against an allow-list (what ``torch.load(weights_only=True)``
    loads, and `ANSWER_GLOBALS`), and it is loaded with that loader. An answer naming any other global, or not in
    ``torch.save``'s format, is refused with `UnsafeAnswer` naming what it holds, before anything of it is built."""
    import importlib
    import io

    import torch

    try:
        named = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(content))
    except Exception as error:  # noqa: BLE001 - whatever the reader makes of bytes it cannot read
        raise UnsafeAnswer(
            f"the trace server's answer is not in torch.save's format ({type(error).__name__}: {error}); this client "
            "loads nothing else"
        ) from None
    refused = sorted(set(named) - set(ANSWER_GLOBALS))
    if refused:
        raise UnsafeAnswer(
            f"the trace server's answer names {', '.join(refused)}, which this client does not load (loading it could "
            "run code): an answer holds tensors, numbers, strings, lists, dicts, tuples and sets, and vLLM's request "
            "outputs; nothing of it was loaded. Is the URL your trace server's?"
        )
    allowed = []
    for name in named:
        module, _, attribute = name.rpartition(".")
        allowed.append(getattr(importlib.import_module(module), attribute))
    with torch.serialization.safe_globals(allowed):
        return torch.load(io.BytesIO(content), map_location="cpu", weights_only=True)


#: Hosts a plain-HTTP key was already warned about (`warn_plain_http`).
_WARNED: set[str] = set()


def warn_plain_http(url: str | None, api_key: str | None) -> None:
    """Warn, once per host, where an API key is about to go over plain HTTP to a host that is not this machine's
    loopback: anyone on the way reads the key (and could answer in the server's place)."""
    import ipaddress
    import urllib.parse
    import warnings

    if not url or not api_key:
        return
    parsed = urllib.parse.urlsplit(url)
    host = parsed.hostname or ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if parsed.scheme != "http" or loopback or host in _WARNED:
        return
    _WARNED.add(host)
    warnings.warn(
        f"the API key goes to {host} over plain HTTP, readable by anyone on the way: start the server with "
        "--ssl-keyfile and --ssl-certfile and send to https://... (a certificate your machine does not trust by "
        "default is named by SSL_CERT_FILE)",
        UserWarning,
        stacklevel=3,
    )
