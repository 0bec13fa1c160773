"""Linear probes read per token inside the steered engine, and the gates that make a spec act only where one fires.

A `Probe` reads the stream leaving its block, ``scores = h @ weight + bias`` (``[classes]`` per token, or one
score), before any steering at that block (the steering of earlier blocks included): requests ask for probes by name
and get each token's scores back (``outputs[0].probes[name]``), after the probe's ``activation`` (``"sigmoid"``,
``"softmax"`` or none). A gate (``when=`` on `Steering`, `Cap`, `Ablate`, `Clamp`) is such a read of one score, or
an SAE feature's activation (its encoder column, bias and threshold), compared with a threshold per token: the spec
acts on the tokens whose gate passes and leaves the others untouched. The engine reads every probe and gate in
flight as one column of a small matrix at every block (``max_probe_columns`` of them), each written where its
block's stream passes: `Probe.resolved` and `gate` give their engine form.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import arguments

WHAT = "Probe"
#: The key of ``SamplingParams.extra_args`` under which a request's probes travel to the engine.
EXTRA_ARGS_KEY = "nnterp_vllm_probes"
#: What a probe's scores go through before they are handed back.
ACTIVATIONS = (None, "sigmoid", "softmax")
#: How a gate compares its read with its threshold, by the number the engine knows it by.
OPERATORS = (">", ">=", "<", "<=")


def probe_weight(weight: Any, what: str) -> torch.Tensor:
    """A probe's weight as ``[hidden, classes]`` float32: a tensor or list (``[hidden]`` or ``[hidden, classes]``), a
    safetensors file holding one tensor (or ``weight`` and, optionally, ``bias``), or a fitted scikit-learn linear
    model (its ``coef_``, ``[classes, hidden]``)."""
    if hasattr(weight, "coef_"):
        weight = torch.as_tensor(weight.coef_, dtype=torch.float32).T
    elif isinstance(weight, (str, os.PathLike)):
        weight = probe_file(Path(weight), what)[0]
    elif isinstance(weight, (list, tuple)):
        weight = torch.tensor(weight, dtype=torch.float32)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() not in (1, 2):
        got = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(
            f"{what}: weight must be a [hidden] or [hidden, classes] float tensor, a safetensors file or a fitted "
            f"scikit-learn linear model, got {got}"
        )
    weight = weight.detach().to(torch.float32)
    if not torch.isfinite(weight).all():
        raise ValueError(f"{what}: weight holds NaN or inf")
    return weight[:, None] if weight.dim() == 1 else weight


def probe_file(path: Path, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A probe's weight and bias from a safetensors file (one tensor, or ``weight`` and ``bias``)."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except Exception as error:  # noqa: BLE001 - safetensors raises several kinds on a missing or damaged file
        raise ValueError(f"{what}: {path} is not a readable safetensors file: {error}") from None
    if "weight" in tensors:
        return tensors["weight"], tensors.get("bias")
    if len(tensors) == 1:
        return next(iter(tensors.values())), None
    raise ValueError(f"{what}: {path} holds {sorted(tensors)}; a probe file holds one tensor, or 'weight' and 'bias'")


@dataclass(frozen=True, eq=False)
class Probe:
    """A linear probe read at block ``layer``'s output for each token at ``positions``: ``h @ weight + bias``.

    Args:
        weight: ``[hidden]`` (one score) or ``[hidden, classes]``: a tensor or nested lists, a safetensors file (one
            tensor, or ``weight`` and ``bias``), or a fitted scikit-learn linear model (``coef_`` and
            ``intercept_``).
        bias: A number, or one per class (the file's or model's own where it has one and this is left at 0).
        layer: The standardized block whose output it reads (negative counts from the last).
        positions: As `Capture` takes them: ``"all"`` (default), ``"prompt"``, ``"generated"``, ``"last"`` or a
            list of prompt positions.
        activation: ``None`` (the scores), ``"sigmoid"`` or ``"softmax"`` (over the classes).
    """

    weight: Any
    bias: Any = 0.0
    layer: int = 0
    positions: str | Sequence[int] = "all"
    activation: str | None = None

    def __post_init__(self) -> None:
        source = self.weight
        weight = probe_weight(source, WHAT)
        bias = self.bias
        if isinstance(source, (str, os.PathLike)) and _is_zero(bias):
            found = probe_file(Path(source), WHAT)[1]
            bias = found if found is not None else bias
        if hasattr(source, "intercept_") and _is_zero(bias):
            bias = torch.as_tensor(source.intercept_, dtype=torch.float32)
        bias = torch.as_tensor(bias, dtype=torch.float32).reshape(-1)
        if bias.numel() == 1:
            bias = bias.expand(weight.shape[1]).clone()
        if bias.numel() != weight.shape[1] or not torch.isfinite(bias).all():
            raise ValueError(
                f"{WHAT}: bias is one finite number or one per class ({weight.shape[1]}), got {list(bias.shape)}"
            )
        if not arguments.is_int(self.layer):
            raise ValueError(f"{WHAT}: layer is a block index, got {self.layer!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"{WHAT}: activation must be None, 'sigmoid' or 'softmax', got {self.activation!r}")
        positions = arguments.phase_or_positions(self.positions, WHAT, ("all", "last", "prompt", "generated"))
        object.__setattr__(self, "weight", weight)
        object.__setattr__(self, "bias", bias)
        object.__setattr__(self, "positions", positions)

    @property
    def classes(self) -> int:
        """How many scores it reads per token."""
        return self.weight.shape[1]

    def scores(self, stream: torch.Tensor) -> torch.Tensor:
        """This probe's scores of ``stream`` (``[..., hidden]``, its block's output) as the engine reads them: the
        product in the stream's dtype, then in float32 the bias added and the activation applied; ``[...]`` for a
        one-score probe, ``[..., classes]`` otherwise."""
        weight = self.weight.to(stream.device, stream.dtype)
        read = activated((stream @ weight).float() + self.bias.to(stream.device), self.activation)
        return read[..., 0] if self.classes == 1 else read

    def resolved(self, name: str, num_layers: int, hidden_size: int) -> dict[str, Any]:
        """This probe in engine form for a model of ``num_layers`` blocks of width ``hidden_size``: its name, block,
        weight (``[classes][hidden]``), bias and activation, and a digest naming what it reads."""
        layer = arguments.layer_indices(self.layer, num_layers, WHAT)[0]
        if self.weight.shape[0] != hidden_size:
            raise ValueError(
                f"{WHAT} {name!r}: weight is {self.weight.shape[0]} wide; this model's stream is {hidden_size}"
            )
        weight, bias = self.weight.T.tolist(), self.bias.tolist()
        return {
            "name": name,
            "layer": layer,
            "weight": weight,
            "bias": bias,
            "activation": self.activation,
            "digest": read_digest(layer, weight, bias),
        }


def _is_zero(bias: Any) -> bool:
    return isinstance(bias, (int, float)) and bias == 0


def read_digest(layer: int, weight: Sequence[Sequence[float]], bias: Sequence[float]) -> str:
    """What a read does (its block, weights and biases), hashed: reads with the same digest share columns."""
    return hashlib.sha256(json.dumps([layer, weight, bias]).encode()).hexdigest()


def probes_of(probes: Any, what: str = "probes") -> dict[str, Probe]:
    """One request's probes: ``None`` or a dict from names to `Probe`s."""
    if probes is None:
        return {}
    if not isinstance(probes, dict) or not all(
        isinstance(name, str) and isinstance(p, Probe) for name, p in probes.items()
    ):
        raise TypeError(f"{what}: probes is None or a dict from names (strings) to Probe, got {type(probes).__name__}")
    return dict(probes)


def per_prompt(probes: Any, count: int) -> list[dict[str, Probe]]:
    """``probes`` as ``generate`` takes it for ``count`` prompts: ``None`` or one dict for every prompt, or a list
    with one entry (a dict or ``None``) per prompt."""
    if isinstance(probes, (list, tuple)):
        if len(probes) != count:
            raise ValueError(f"probes: {len(probes)} entries for {count} prompts; give one dict or one per prompt")
        return [probes_of(entry, f"probes[{index}]") for index, entry in enumerate(probes)]
    return [probes_of(probes)] * count


def gate(when: Any, num_layers: int, hidden_size: int, what: str) -> dict[str, Any]:
    """A spec's ``when`` in engine form: ``(Probe, op, threshold)`` (a one-score probe; a sigmoid probe compares its
    probability) or ``(sae, feature, op, threshold)`` (the feature's activation by its SAE's encoder; not a TopK
    SAE's, which depends on all its features); ``ValueError`` naming what is wrong."""
    from .saes import as_sae

    if not isinstance(when, tuple) or len(when) not in (3, 4):
        raise ValueError(
            f"{what}: when is (Probe, op, threshold) or (sae, feature, op, threshold), op one of {OPERATORS}, got "
            f"{when!r}"
        )
    op, threshold = when[-2], arguments.finite_number(when[-1], what, "when's threshold")
    if op not in OPERATORS:
        raise ValueError(f"{what}: when's op must be one of {', '.join(OPERATORS)}, got {op!r}")
    if len(when) == 3:
        probe = when[0]
        if not isinstance(probe, Probe) or probe.classes != 1 or probe.activation == "softmax":
            raise ValueError(
                f"{what}: a gate reads one score: a Probe with a [hidden] weight, no softmax, got {probe!r}"
            )
        read = probe.resolved("when", num_layers, hidden_size)
        layer, weight, bias, floor, sigmoid = (
            read["layer"],
            read["weight"][0],
            read["bias"][0],
            None,
            probe.activation == "sigmoid",
        )
    else:
        sae, feature = as_sae(when[0], what), when[1]
        if sae.architecture == "topk":
            raise ValueError(
                f"{what}: a TopK SAE's feature depends on all of its features; gate on another SAE or a probe"
            )
        if not arguments.is_int(feature) or not 0 <= feature < sae.d_sae:
            raise ValueError(f"{what}: when's feature must be an int in 0..{sae.d_sae - 1}, got {feature!r}")
        if sae.layer >= num_layers or sae.d_in != hidden_size:
            raise ValueError(
                f"{what}: when's SAE {sae.path} reads block {sae.layer}, {sae.d_in} wide; this model has "
                f"{num_layers} blocks, {hidden_size} wide"
            )
        direction, offset, floor = sae.feature_encoder(feature)
        layer, weight, bias, sigmoid = sae.layer, direction.tolist(), offset, False
    return {
        "layer": layer,
        "weight": weight,
        "bias": bias,
        "floor": floor,
        "sigmoid": sigmoid,
        "op": OPERATORS.index(op),
        "threshold": threshold,
        "digest": read_digest(layer, [weight], [bias]),
    }


#: Each of `OPERATORS` as a comparison of tensors, in its order.
COMPARISONS = (torch.gt, torch.ge, torch.lt, torch.le)


def gate_passes(read: dict[str, Any], stream: torch.Tensor) -> torch.Tensor:
    """Which tokens of ``stream`` (``[..., hidden]``, the stream leaving the gate's block before the steering there)
    pass a gate in engine form (`gate`): its read ``stream @ weight + bias`` (the product in the stream's dtype,
    then float32), through a sigmoid where asked and zero up to its floor, compared with its threshold; a bool
    tensor of the stream's leading shape, as the steered engine computes it per token."""
    weight = torch.tensor(read["weight"], dtype=stream.dtype, device=stream.device)
    score = (stream @ weight).float() + read["bias"]
    if read["sigmoid"]:
        score = score.sigmoid()
    if read["floor"] is not None:
        score = torch.where(score > read["floor"], score, torch.zeros_like(score))
    return COMPARISONS[read["op"]](score, read["threshold"])


def activated(scores: torch.Tensor, activation: str | None) -> torch.Tensor:
    """A probe's scores (``[..., classes]``) after its activation."""
    if activation == "sigmoid":
        return scores.sigmoid()
    if activation == "softmax":
        return scores.softmax(-1)
    return scores


__all__ = ["Probe", "activated", "gate", "gate_passes", "per_prompt", "probes_of"]
