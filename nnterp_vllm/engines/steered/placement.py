"""Where the steered engine's static operations sit in vLLM's compiled model, and when they run.

The operations the engine adds (capture's `kept_rows.keep_rows`, the steering table's probe write) are registered
as graph operations (`graph_op`); the hooks that call them sit at the locations of standardized values, found on the
loaded model through its family by the descriptors nnsight reads (`locate`), and run at a call where `runs` says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ... import families
from ...components import Layers
from ...components.names import STATIC_ROOT_VALUES
from ...components.values import Located
from ...standardized import standard_rename

#: The library holding the operations the engines add to vLLM's compiled graph (`graph_op`).
GRAPH_OPS = torch.library.Library("nnterp_vllm", "FRAGMENT")


def graph_op(mutates: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register a function that writes its argument ``mutates`` in place as ``torch.ops.nnterp_vllm.<its name>``:
    opaque to the compiler, so the compiled graph calls it and the buffer is written where it is (no copy of it),
    and called straight through the dispatcher, as vLLM registers its own operations (`torch.library.custom_op`'s
    dispatch costs several times these small writes, paid at every block of every step)."""

    def register(function: Callable[..., None]) -> Callable[..., None]:
        name = function.__name__
        GRAPH_OPS.define(name + torch.library.infer_schema(function, mutates_args=(mutates,)))
        GRAPH_OPS.impl(name, function, "CompositeExplicitAutograd")
        torch.library.register_fake(f"nnterp_vllm::{name}", lambda *args: None, lib=GRAPH_OPS)
        return function

    return register


def runs(buffers: torch.nn.Module) -> bool:
    """Whether an operation on an engine's ``buffers`` runs at this call: always inside a compiled graph (traced once,
    for every step); outside one (an eager step: a trace's code or a TopK clamp in it, or an engine built eagerly)
    only where the step uses them (``buffers.idle`` false), each such run counted on ``buffers.eager_calls``."""
    if torch.compiler.is_compiling():  # folded away when traced: the operation is in the graph for every step
        return True
    if buffers.idle:
        return False
    buffers.eager_calls += 1
    return True


@contextlib.contextmanager
def standard_tree(model: torch.nn.Module, family: Any) -> Iterator[Any]:
    """The nnsight envoy tree over a loaded model with ``family``'s names and classes, to locate values by the
    same descriptors nnsight reads; every module gets back what building the tree installed on it (nnsight's
    controllers) on the way out, so the model vLLM compiles carries nothing of it."""
    from nnsight.intervention.envoy import Envoy
    from nnsight.intervention.source import STATE

    missing = object()
    before = [(module, module.__dict__.get("forward", missing)) for module in model.modules()]
    root = type("FamilyRoot", (Envoy,), {"family": family})  # what root values ask of their model
    try:
        yield root(model, rename=standard_rename(family), envoys={"layers": Layers, **family.ENVOYS})
    finally:
        for module, forward in before:
            module.__dict__.pop(STATE, None)
            if forward is missing:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = forward


def locate(model: torch.nn.Module, model_type: str, names: Sequence[str]) -> dict[str, Located | str]:
    """Each value name (``layers.3.layer_output``, ``token_embeddings``) -> where it lives on ``model`` and how it
    is read there (`Located`), or why the engine cannot keep it."""
    from ..vllm import StandardizedVLLM

    family = families.lookup(model_type, engine=families.VLLM)
    found: dict[str, Located | str] = {}
    with standard_tree(model, family) as root:
        for name in names:
            if name in STATIC_ROOT_VALUES:
                host, descriptor = root, getattr(StandardizedVLLM, name)
            else:
                _, layer, key = name.split(".", 2)
                host = root.layers[int(layer)]
                *modules, value = key.split(".")
                for part in modules:
                    host = getattr(host, part, None)
                    if host is None:
                        break
                descriptor = getattr(type(host), value, None)
            if host is None or descriptor is None:
                found[name] = f"{family.__name__} has no {name}"
            else:
                found[name] = descriptor.located(host)
    return found


__all__ = ["graph_op", "locate", "runs", "standard_tree"]
