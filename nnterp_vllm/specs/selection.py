"""Which values a harvest reads: ``layers.*.layer_output``-style selectors, checked against the model.

A selector names a per-token value: a root value (``token_embeddings``, ``final_norm_output``,
``logits``, ``lm_head_output``), a block value with a layer part (an index, ``*``, a range
``2-5`` or a list ``1,3``) and, for a module's value, the module (``layers.3.self_attn.attention_probabilities``),
or a probe's scores (``probes.NAME``: the probe ``NAME`` the harvest is given, read from its block's
``layer_output``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..components.names import (
    BLOCK_ORDER,
    HEADS_FIRST,
    MODULE_OUTPUTS,
    PATTERNS,
    ROOT_AFTER_LAYERS,
    ROOT_BEFORE_LAYERS,
    ROOT_VALUES,
    SHORT_NAMES,
)

if TYPE_CHECKING:
    from .probes import Probe

#: The prefix of a probe's value: ``probes.NAME`` is the scores of the probe named ``NAME``.
PROBES = "probes."
#: The dtype probe scores are stored in, whatever the harvest's.
PROBE_DTYPE = "float32"


@dataclass(frozen=True)
class Selection:
    """One value of one block (or of the root) to harvest."""

    layer: int | None
    key: str  # "layer_output", "self_attn.attention_probabilities", or a root value
    #: A probe's value: the probe's name and the probe, which reads block ``layer``'s ``key`` (its layer_output).
    probe: tuple[str, Probe] | None = None

    @property
    def name(self) -> str:
        """The name on disk: ``layers.3.self_attn.attention_probabilities``, the root value's, or ``probes.NAME``."""
        if self.probe is not None:
            return PROBES + self.probe[0]
        return self.key if self.layer is None else f"layers.{self.layer}.{self.key}"

    @property
    def source(self) -> str:
        """The name of the model's value this one is read from (a trace reads each once): its own, or, for a probe's
        scores, its block's ``layer_output``."""
        return self.name if self.probe is None else f"layers.{self.layer}.{self.key}"

    def stored_dtype(self, dtype: str) -> str:
        """The dtype this value is stored in by a harvest storing activations in ``dtype``: probe scores in
        `PROBE_DTYPE`, the others in ``dtype``."""
        return dtype if self.probe is None else PROBE_DTYPE

    @property
    def value(self) -> str:
        return self.key.rsplit(".", 1)[-1]

    def order(self) -> tuple[int, int]:
        """Where a forward reaches this value, for reading in forward order."""
        if self.layer is None:
            return (-1, 0) if self.key in ROOT_BEFORE_LAYERS else (1 << 30, ROOT_AFTER_LAYERS.index(self.key))
        return (self.layer, BLOCK_ORDER.index(self.key))

    def read(self, model: Any) -> torch.Tensor:
        """The value, inside a trace."""
        host = model if self.layer is None else model.layers[self.layer]
        for part in self.key.split("."):
            host = getattr(host, part)
        return host

    def module_path(self, model: Any) -> str | None:
        """The path of the module whose output this value is, as the model names it (``model.layers.6``
        for ``layers.6.layer_output`` on a llama), following the family to where the value lives; None
        for a value that is no module's whole output (a block's input, the attention interior, logits, a probe's)."""
        from ..components.values import Delegate

        if self.key not in MODULE_OUTPUTS or self.probe is not None:
            return None
        host = model if self.layer is None else model.layers[self.layer]
        *parents, name = self.key.split(".")
        for part in parents:
            host = getattr(host, part)
        descriptor = getattr(type(host), name)
        while isinstance(descriptor, Delegate):
            host = descriptor.host_of(host)
            descriptor = getattr(type(host), descriptor.target)
        location, attribute = descriptor.locate(host)
        root = f"{model.path}."
        if attribute != "output" or ".source." in location or not location.startswith(root):
            return None
        return location.removeprefix(root).removesuffix(".output")

    def per_token(self, value: torch.Tensor, length: int, context_length: int | None) -> torch.Tensor:
        """One row's value as ``[tokens, ...]``: the first ``length`` positions, patterns padded to the context; a
        probe's scores of its block's output (`Probe.scores`)."""
        if self.probe is not None:
            return self.probe[1].scores(value[0, :length])
        if self.value in HEADS_FIRST:
            value = value.movedim(1, 2)
        value = value[0, :length]
        if self.value in PATTERNS:
            value = torch.nn.functional.pad(value[..., :length], (0, context_length - length))
        return value


LAYER_PART = "an index, '*', a range 'a-b' with a <= b, or a list of those such as '1,4-6'"


#: Every value a selector may name, for error messages.
KNOWN = ", ".join([*ROOT_VALUES, *(f"layers.<i>.{key}" for key in BLOCK_ORDER)])


def _layer_ranges(part: str, selector: str) -> list[tuple[int, int]] | None:
    """The ``(first, last)`` ranges a layer part names (None for ``*``), checked without a model."""
    if part == "*":
        return None
    pieces = []
    for piece in part.split(","):
        bounds = piece.split("-")
        if len(bounds) > 2 or not all(bound.isascii() and bound.isdigit() for bound in bounds):
            raise ValueError(f"{selector!r}: the layer part {part!r} is not {LAYER_PART}")
        first, last = int(bounds[0]), int(bounds[-1])
        if first > last:
            raise ValueError(f"{selector!r}: the range {piece!r} runs backwards; write '{last}-{first}'")
        pieces.append((first, last))
    return pieces


@dataclass(frozen=True)
class Selector:
    """A selector's parts, its syntax checked: a root value, or a block value with its layer ranges."""

    text: str
    key: str
    ranges: tuple[tuple[int, int], ...] | None = None  # (first, last) pairs; None: every layer
    root: bool = False
    #: A ``probes.NAME`` selector's probe (its name and the `Probe`, reading its block's layer_output; ``key`` and
    #: ``ranges`` say what it reads, where its layer counts from the first block).
    probe: tuple[str, Probe] | None = None

    @classmethod
    def of(cls, selector: Any) -> Selector:
        """``selector`` split into its parts; refuses one that no model could have."""
        if isinstance(selector, Selector):
            return selector
        if not isinstance(selector, str):
            raise TypeError(
                f"a value to harvest is a selector string such as 'layers.*.layer_output', not {selector!r}"
            )
        if selector in ROOT_VALUES:
            return cls(selector, selector, root=True)
        parts = selector.split(".", 2)
        if len(parts) == 3:
            parts[2] = SHORT_NAMES.get(parts[2], parts[2])
        if parts[0] != "layers" or len(parts) < 3 or parts[2] not in BLOCK_ORDER:
            raise ValueError(f"unknown value {selector!r}; the values to harvest are: {KNOWN}")
        ranges = _layer_ranges(parts[1], selector)
        return cls(selector, parts[2], None if ranges is None else tuple(ranges))

    def layers(self, count: int) -> list[int]:
        """The layer indices named, checked against a model of ``count`` layers."""
        layers = list(range(count)) if self.ranges is None else [i for a, b in self.ranges for i in range(a, b + 1)]
        bad = sorted({layer for layer in layers if layer >= count})
        if bad:
            raise ValueError(
                f"{self.text!r}: layer(s) {bad} do not exist; the model has num_layers={count} (0..{count - 1})"
            )
        return layers


def probe_selector(selector: str, probes: dict[str, Probe]) -> Selector:
    """The selector ``probes.NAME`` of the probe ``probes[NAME]``; ValueError where there is none, or where the probe
    keeps positions of its own (the harvest's ``positions`` are every value's)."""
    name = selector.removeprefix(PROBES)
    if name not in probes:
        raise ValueError(f"{selector!r}: no probe named {name!r} in probes= (it holds {sorted(probes) or 'none'})")
    probe = probes[name]
    if probe.positions != "all":
        raise ValueError(
            f"{selector}: the harvest's positions= choose the tokens of every value; build the probe with "
            f"positions='all', not {probe.positions!r}"
        )
    ranges = None if probe.layer < 0 else ((probe.layer, probe.layer),)  # a negative layer: known with the model
    return Selector(selector, "layer_output", ranges, probe=(name, probe))


def check_selectors(
    selectors: Iterable[str] | str, context_length: int | None, probes: dict[str, Probe] | None = None
) -> list[Selector]:
    """The selectors, their syntax checked before any model is loaded; ``probes.NAME`` against ``probes``.

    Raises ValueError (TypeError for a selector that is not a string) naming the selector and
    what would be right: an unknown value, a malformed or backwards layer part, a pattern without
    a context length, a probe not in ``probes`` or one of ``probes`` no selector reads. Layer ranges,
    availability and probe widths are checked against the model by `parse`.
    """
    selectors = [selectors] if isinstance(selectors, str) else selectors
    if not isinstance(selectors, Iterable):
        raise TypeError(f"values must be a selector string or a list of them, not {selectors!r}")
    probes = probes or {}
    parsed = [
        probe_selector(selector, probes)
        if isinstance(selector, str) and selector.startswith(PROBES)
        else Selector.of(selector)
        for selector in selectors
    ]
    if not parsed:
        raise ValueError(f"no values to harvest; choose from: {KNOWN}")
    for selector in parsed:
        if selector.key.rsplit(".", 1)[-1] in PATTERNS and context_length is None:
            raise ValueError(f"{selector.text}: harvesting a pattern needs a context length (--context-length)")
    read = {selector.probe[0] for selector in parsed if selector.probe is not None}
    unread = [name for name in probes if name not in read]
    if unread:
        raise ValueError(
            f"probes {unread} are given but no value reads them: add {[PROBES + name for name in unread]} to "
            "values, or leave them out of probes="
        )
    return parsed


def blocks_needed(selectors: list[Selector]) -> int | None:
    """How many blocks a forward must run to reach every value ``selectors`` name: up to the deepest block
    named (at least one); None where that is every block (a value after the blocks, or ``layers.*``)."""
    deepest = 0
    for selector in selectors:
        if selector.root:
            if selector.key in ROOT_AFTER_LAYERS:
                return None
            continue
        if selector.ranges is None:
            return None
        deepest = max(deepest, *(last + 1 for _, last in selector.ranges))
    return max(deepest, 1)


def parse(selectors: Iterable[str] | str, model: Any, context_length: int | None) -> list[Selection]:
    """The selections ``selectors`` name on ``model``, in forward order; refuses unknown or unavailable values."""
    table = model.support()
    chosen: dict[str, Selection] = {}
    for selector in check_selectors(selectors, context_length):
        if selector.probe is not None:
            # Read by the engine itself (`in_engine`), or from the block's layer_output, which every model has.
            name, probe = selector.probe
            layer = probe.resolved(name, model.num_layers, model.hidden_size)["layer"]
            chosen[selector.text] = Selection(layer, selector.key, selector.probe)
            continue
        if selector.root:
            selections = [Selection(None, selector.key)]
        else:
            selections = [Selection(layer, selector.key) for layer in selector.layers(model.num_layers)]
        for selection in selections:
            reason = table.get(selection.key, f"this model has no {selection.key}")
            if isinstance(reason, dict):
                reason = reason.get(selection.layer)
            if reason:
                raise ValueError(f"{selection.name} is not available on this model: {reason}")
            chosen[selection.name] = selection
    return sorted(chosen.values(), key=Selection.order)


def token_shape(selection: Selection, model: Any, context_length: int | None) -> list[int]:
    """The shape of one token's value on disk."""
    if selection.probe is not None:
        classes = selection.probe[1].classes
        return [] if classes == 1 else [classes]
    value = selection.value
    if value in ("logits", "lm_head_output"):
        return [model.vocab_size]
    if value in ("attention_queries", "attention_premix"):
        return [model.num_heads, model.head_dim]
    if value in ("attention_keys", "attention_values"):
        return [model.num_kv_heads, model.head_dim]
    if value in PATTERNS:
        return [model.num_heads, context_length]
    if value == "attention_head_outputs":
        return [model.num_heads, model.hidden_size]
    if value == "router_logits":
        return [model.num_experts]
    if value in ("expert_indices", "expert_weights"):
        return [model.num_experts_per_token]
    if value == "sae_features":
        return [model.saes.at(selection.layer).d_sae]
    return [model.hidden_size]
