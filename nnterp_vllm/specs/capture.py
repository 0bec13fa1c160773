"""`Capture`: a declarative capture spec, checked on the client, carried per request into the engine.

The mirror of `Steering`: which standardized values of a request the engine keeps, at which of its
positions, in which dtype. Values are named as the harvest names them (``"layers.*.layer_output"``,
``"layers.6.mlp_output"``, ``"layers.3.attention_input"``, ``"token_embeddings"``); the engine keeps
those that are a ``[tokens, hidden]`` stream at a module's input or output (`STATIC_VALUES`), each by one
static operation inside its compiled graph. What is computed inside fused kernels or by code only a trace
runs (the attention interior, the experts' choice, logits) is read through nnsight (`StandardizedVLLM`).

The spec is checked twice, with the errors the harvest's selectors and `arguments` raise: what needs no
model when it is made (the selectors' syntax, the position form, the dtype), the rest against the
engine and the rendered prompt (layers, the values the engine keeps, positions inside the prompt)
before the request is sent. What travels to the engine is `Capture.resolved`'s plain form.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import arguments
from ..components.names import SAE_FEATURES, STATIC_VALUES
from .selection import Selection, Selector

WHAT = "Capture"
#: The key of ``SamplingParams.extra_args`` under which a request's capture travels to the engine.
EXTRA_ARGS_KEY = "nnterp_vllm_capture"
#: Features per token a capture of ``sae_features`` keeps unless told.
TOP_K = 32
#: Which of a request's positions are kept, besides a list of prompt positions.
PHASES = ("all", "last", "prompt", "generated")
NNSIGHT_PATH = (
    "the engine keeps only [tokens, hidden] streams at a module's input or output "
    f"({', '.join(STATIC_VALUES)}); read it through nnsight: StandardizedVLLM, or harvest(..., engine='vllm'), "
    "which takes that path for it"
)


def static_selectors(values: Any, what: str, also: Sequence[str] = ()) -> list[Selector]:
    """``values`` (a selector or a list of them) checked as values the engine keeps (or ``also`` names); ValueError
    naming any other (TypeError for a selector that is not a string)."""
    listed = [values] if isinstance(values, str) else values
    if not isinstance(listed, (list, tuple)) or not listed:
        raise (TypeError if not isinstance(listed, (list, tuple)) else ValueError)(
            f"{what}: values is a selector such as 'layers.*.layer_output' or a non-empty list of them, got {values!r}"
        )
    selectors = [Selector.of(value) for value in listed]
    for selector in selectors:
        if selector.key == SAE_FEATURES and SAE_FEATURES not in also:
            raise ValueError(
                f"{what}: {selector.text!r} is encoded from a block's kept layer_output: keep that (e.g. "
                "'layers.6.layer_output') and hold the SAE (saes=[...]); a Capture then asks for its features"
            )
        if selector.key not in STATIC_VALUES + tuple(also):
            raise ValueError(f"{what}: {selector.text!r} is not kept by the engine: {NNSIGHT_PATH}")
    return selectors


def value_names(selectors: Sequence[Selector], num_layers: int) -> list[str]:
    """The names ``selectors`` expand to on a model of ``num_layers`` blocks (``layers.10.layer_output``, one per
    block for a ``*``), in forward order, each once; ValueError for a layer the model lacks."""
    chosen: dict[str, Selection] = {}
    for selector in selectors:
        layers = [None] if selector.root else selector.layers(num_layers)
        for layer in layers:
            selection = Selection(layer, selector.key)
            chosen[selection.name] = selection
    return [selection.name for selection in sorted(chosen.values(), key=Selection.order)]


def kept_dtype(dtype: Any, what: str) -> torch.dtype | None:
    """``dtype`` (``None``, a floating ``torch.dtype`` or its name such as ``"float16"``) as a torch dtype."""
    if dtype is None:
        return None
    named = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(named, torch.dtype) or not named.is_floating_point:
        raise ValueError(
            f"{what}: dtype must be a floating torch dtype or its name ('float32', 'float16', 'bfloat16'), "
            f"got {dtype!r}"
        )
    return named


@dataclass(frozen=True, eq=False)
class Capture:
    """Keep ``values`` of a request at ``positions``, as ``dtype``: they come back on its ``RequestOutput``.

    Args:
        values: A selector or a list of them, as the harvest takes them: ``"layers.*.layer_output"``,
            ``"layers.6.mlp_output"``, ``"layers.2-4.attention_input"``, ``"token_embeddings"`` (`STATIC_VALUES`).
        positions: ``"all"`` (default: the prompt and each generated token fed back in), ``"last"`` (the prompt's
            last token), ``"prompt"``, ``"generated"``, or a list of prompt positions (negative counting from the
            prompt's end).
        dtype: What the kept rows are stored as (``"float16"``, ``torch.bfloat16``, ...); the model's by default.
        top_k: For ``"layers.N.sae_features"`` (the features of the SAE the engine holds at block N): each token's
            ``top_k`` largest features, as ``"layers.N.sae_features.indices"`` (int64) and
            ``"layers.N.sae_features.values"`` (float32) ``[kept tokens, top_k]``; or
        features: those features' activations, dense: ``"layers.N.sae_features"`` ``[kept tokens, len(features)]``
            (float32), in the order given.

    The checks that need no model run here; the layers, the values the engine keeps and the positions
    against the prompt are checked when a request carrying the spec is made.
    """

    values: str | Sequence[str]
    positions: str | Sequence[int] = "all"
    dtype: str | torch.dtype | None = field(default=None)
    top_k: int = TOP_K
    features: Sequence[int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", static_selectors(self.values, WHAT, (SAE_FEATURES,)))
        object.__setattr__(self, "positions", arguments.phase_or_positions(self.positions, WHAT, PHASES))
        object.__setattr__(self, "dtype", kept_dtype(self.dtype, WHAT))
        if not arguments.is_int(self.top_k) or self.top_k < 1:
            raise ValueError(f"{WHAT}: top_k must be an int >= 1, got {self.top_k!r}")
        if self.features is not None:
            listed = arguments.listed_ints(self.features)
            if listed is None or min(listed) < 0:
                raise ValueError(
                    f"{WHAT}: features must be a non-empty list of feature indices >= 0, got {self.features!r}"
                )
            object.__setattr__(self, "features", listed)

    def names(self, num_layers: int) -> list[str]:
        """The value names this spec keeps on a model of ``num_layers`` blocks, in forward order."""
        return value_names(self.values, num_layers)

    def resolved(
        self,
        num_layers: int,
        kept: Sequence[str],
        prompt_length: int,
        dtype: torch.dtype,
        saes: Sequence[dict[str, Any]] = (),
    ) -> dict[str, Any]:
        """This spec in its engine form for a prompt of ``prompt_length`` tokens on an engine keeping the values
        ``kept`` of a model of ``num_layers`` blocks in ``dtype`` and holding ``saes`` (each ``{"name", "layer",
        "d_sae", ...}``): a fresh key naming the request's rows, the kept value names (a block's ``layer_output``
        for its SAE's features), the phase or sorted absolute prompt positions, the dtype's name, and where SAE
        features are asked for, what to encode (``"sae"``) and the names handed back (``"returned"``). Raises
        ValueError naming a value the engine does not keep, an SAE it does not hold, a feature the SAE lacks, or a
        position outside the prompt."""
        asked = self.names(num_layers)
        encoded = []
        for name in asked:
            if not name.endswith(f".{SAE_FEATURES}"):
                continue
            layer = int(name.split(".")[1])
            held = next((sae for sae in saes if sae["layer"] == layer), None)
            if held is None:
                holding = ", ".join(f"{sae['name']} at block {sae['layer']}" for sae in saes) or "none"
                raise ValueError(
                    f"{WHAT}: {name} needs an SAE reading block {layer}'s output; the engine holds {holding} (build "
                    "it with saes=[...])"
                )
            features = self.features
            if features is not None and max(features) >= held["d_sae"]:
                raise ValueError(
                    f"{WHAT}: features {[f for f in features if f >= held['d_sae']]} do not exist in SAE "
                    f"{held['name']!r} ({held['d_sae']} features, 0..{held['d_sae'] - 1})"
                )
            top_k = None if features is not None else min(self.top_k, held["d_sae"])
            source = f"layers.{layer}.layer_output"
            encoded.append({"name": name, "source": source, "layer": layer, "top_k": top_k, "features": features})
        by_name = {entry["name"]: entry for entry in encoded}
        names = list(dict.fromkeys(by_name[name]["source"] if name in by_name else name for name in asked))
        missing = [name for name in names if name not in kept]
        if missing:
            kept_text = ", ".join(kept) if kept else "none"
            raise ValueError(
                f"{WHAT}: the engine keeps no {', '.join(missing)}; it was built to keep {kept_text} "
                "(build it with capture_values= naming every value requests may capture)"
            )
        positions = self.positions
        if not isinstance(positions, str):
            positions = sorted(set(arguments.positions_within(positions, prompt_length, WHAT)))
        wire = {
            "key": uuid.uuid4().hex,
            "values": names,
            "positions": positions,
            "prompt_tokens": prompt_length,
            "dtype": str(self.dtype or dtype).removeprefix("torch."),
        }
        if encoded:
            wire["sae"] = encoded
            wire["returned"] = [
                returned for name in asked for returned in (sae_names(by_name[name]) if name in by_name else [name])
            ]
        return wire


def sae_names(entry: dict[str, Any]) -> list[str]:
    """The names an SAE-feature capture (an entry of a wire's ``"sae"``) hands back: the top-k's indices and
    values, or the chosen features' activations."""
    if entry["features"] is not None:
        return [entry["name"]]
    return [f"{entry['name']}.indices", f"{entry['name']}.values"]


def per_prompt(capture: Any, count: int) -> list[Capture | None]:
    """``capture`` as given to ``generate`` for ``count`` prompts: one spec (or ``None``) per prompt.

    ``None`` or one `Capture` is for every prompt; a list holds one entry per prompt (``None`` or a `Capture`).
    """
    if capture is None or isinstance(capture, Capture):
        return [capture] * count
    if isinstance(capture, (list, tuple)) and all(entry is None or isinstance(entry, Capture) for entry in capture):
        if len(capture) != count:
            raise ValueError(
                f"{WHAT}: capture has {len(capture)} entries for {count} prompts; give one Capture (or None) "
                "for every prompt, or a list with one entry per prompt"
            )
        return list(capture)
    raise TypeError(
        f"{WHAT}: capture is None, a Capture, or a list with a Capture or None per prompt, got {type(capture).__name__}"
    )


def reads_prompt_from_cache(wire: dict[str, Any]) -> bool:
    """Whether a request capturing ``wire`` may take its prompt from the prefix cache: only where every kept
    position is computed anyway (generated tokens, the prompt's last token, which vLLM always computes)."""
    positions, length = wire["positions"], wire["prompt_tokens"]
    if isinstance(positions, str):
        return positions in ("generated", "last")
    return min(positions) >= length - 1


def kept_count(wire: dict[str, Any], fed: int) -> int:
    """How many rows a request capturing ``wire`` keeps when ``fed`` of its tokens went through the model
    (its prompt and each generated token fed back in)."""
    positions, length = wire["positions"], wire["prompt_tokens"]
    if not isinstance(positions, str):
        return len(positions)
    return {"all": fed, "prompt": length, "generated": max(0, fed - length), "last": 1}[positions]


def kept_runs(wire: dict[str, Any], position: int, count: int) -> list[tuple[int, int, int]]:
    """The rows a request capturing ``wire`` keeps of ``count`` tokens at ``position`` onwards, as runs
    ``(first token, first row, length)``: token ``first token + i`` (counted from ``position``) is row
    ``first row + i`` of the request's kept rows (its positions' order)."""
    positions, length = wire["positions"], wire["prompt_tokens"]
    end = position + count
    if positions == "all":
        first, last, row = position, end, position
    elif positions == "prompt":
        first, last, row = position, min(end, length), position
    elif positions == "generated":
        first, last = max(position, length), end
        row = first - length
    elif positions == "last":
        first, last, row = max(position, length - 1), min(end, length), 0
    else:
        runs: list[tuple[int, int, int]] = []
        for row, kept in enumerate(positions):
            if position <= kept < end:
                if runs and runs[-1][0] + runs[-1][2] == kept - position and runs[-1][1] + runs[-1][2] == row:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
                else:
                    runs.append((kept - position, row, 1))
        return runs
    return [(first - position, row, last - first)] if last > first else []


__all__ = ["EXTRA_ARGS_KEY", "Capture", "per_prompt"]
