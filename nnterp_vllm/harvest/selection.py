"""Which values a harvest reads: ``layers.*.layer_output``-style selectors, checked against the model.

A selector names a per-token value: a root value (``token_embeddings``, ``final_norm_output``,
``logits``, ``lm_head_output``), or a block value with a layer part (an index, ``*``, a range
``2-5`` or a list ``1,3``) and, for a module's value, the module (``layers.3.self_attn.attention_probabilities``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

#: Root values that are per token (the others are per prompt or are the inputs themselves).
ROOT_BEFORE_LAYERS = ("token_embeddings",)
ROOT_AFTER_LAYERS = ("final_norm_output", "lm_head_output", "logits")
#: Block values in the order a forward reaches them.
BLOCK_ORDER = (
    "layer_input",
    "self_attn.attention_queries",
    "self_attn.attention_keys",
    "self_attn.attention_values",
    "self_attn.attention_scores",
    "self_attn.attention_probabilities",
    "self_attn.attention_premix",
    "self_attn.attention_head_outputs",
    "self_attn.attention_output",
    "attention_output",
    "mixer.mixer_output",
    "mixer_output",
    "mlp.router_logits",
    "mlp.expert_indices",
    "mlp.expert_weights",
    "mlp.mlp_output",
    "mlp_output",
    "layer_output",
)
#: Values laid out ``[batch, heads, seq, ...]`` rather than ``[batch, seq, ...]``.
HEADS_FIRST = {"attention_queries", "attention_keys", "attention_values", "attention_scores", "attention_probabilities"}
#: Values with a key axis as long as the row: padded to the context length on disk.
PATTERNS = {"attention_scores", "attention_probabilities"}


@dataclass(frozen=True)
class Selection:
    """One value of one block (or of the root) to harvest."""

    layer: int | None
    key: str  # "layer_output", "self_attn.attention_probabilities", or a root value

    @property
    def name(self) -> str:
        """The name on disk: ``layers.3.self_attn.attention_probabilities``, or the root value's."""
        return self.key if self.layer is None else f"layers.{self.layer}.{self.key}"

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

    def per_token(self, value: torch.Tensor, length: int, context_length: int | None) -> torch.Tensor:
        """One row's value as ``[tokens, ...]``: the first ``length`` positions, patterns padded to the context."""
        if self.value in HEADS_FIRST:
            value = value.movedim(1, 2)
        value = value[0, :length]
        if self.value in PATTERNS:
            value = torch.nn.functional.pad(value[..., :length], (0, context_length - length))
        return value


def _layers(part: str, count: int, selector: str) -> list[int]:
    if part == "*":
        return list(range(count))
    chosen: list[int] = []
    for piece in part.split(","):
        bounds = piece.split("-")
        if not all(bound.isdigit() for bound in bounds) or len(bounds) > 2:
            raise ValueError(
                f"{selector!r}: the layer part {part!r} must be an index, '*', a range 'a-b' or a list 'a,b'"
            )
        first, last = int(bounds[0]), int(bounds[-1])
        chosen.extend(range(first, last + 1))
    bad = [layer for layer in chosen if layer >= count]
    if bad:
        raise ValueError(
            f"{selector!r}: layer(s) {bad} do not exist; the model has num_layers={count} (0..{count - 1})"
        )
    return chosen


def parse(selectors: Iterable[str], model: Any, context_length: int | None) -> list[Selection]:
    """The selections ``selectors`` name on ``model``, in forward order; refuses unknown or unavailable values."""
    table = model.support()
    block_names = [key for key in BLOCK_ORDER if key in table]
    root_names = [key for key in (*ROOT_BEFORE_LAYERS, *ROOT_AFTER_LAYERS) if key in table]
    available = ", ".join([*root_names, *(f"layers.<i>.{key}" for key in block_names)])
    chosen: dict[str, Selection] = {}
    selectors = list(selectors)
    if not selectors:
        raise ValueError(f"no values to harvest; choose from: {available}")
    for selector in selectors:
        if selector.startswith("layers."):
            parts = selector.split(".", 2)
            if len(parts) < 3 or parts[2] not in block_names:
                raise ValueError(f"unknown value {selector!r}; the values to harvest are: {available}")
            selections = [Selection(layer, parts[2]) for layer in _layers(parts[1], model.num_layers, selector)]
        elif selector in root_names:
            selections = [Selection(None, selector)]
        else:
            raise ValueError(f"unknown value {selector!r}; the values to harvest are: {available}")
        for selection in selections:
            reason = table[selection.key]
            if isinstance(reason, dict):
                reason = reason.get(selection.layer)
            if reason:
                raise ValueError(f"{selection.name} is not available on this model: {reason}")
            if selection.value in PATTERNS and context_length is None:
                raise ValueError(f"{selection.name}: harvesting a pattern needs a context length (--context-length)")
            chosen[selection.name] = selection
    return sorted(chosen.values(), key=Selection.order)


def token_shape(selection: Selection, model: Any, context_length: int | None) -> list[int]:
    """The shape of one token's value on disk."""
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
    return [model.hidden_size]
