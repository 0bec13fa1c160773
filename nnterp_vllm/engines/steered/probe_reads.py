"""Probe scores handed back per token, on the steered engine's worker (`specs.probes`).

Every block's hook writes the scores of the probe columns read there into the step's ``probe scores`` buffer
(`steering_table.SteeringTable.read_probes`). Before each step the runner lays out which tokens of each request
carrying probes each probe keeps (its positions, as a `Capture`'s: `capture.kept_runs`); after the forward one
gather on the device takes those tokens' rows and each probe's columns out of the buffer, kept on the device until
the client takes the request's scores (`ProbeReader.take`), in position order, prompt and generated tokens alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...specs.capture import kept_runs
from ...specs.probes import EXTRA_ARGS_KEY
from .steering_pool import PLACED
from .tensor_wire import pack


class ProbeReader:
    """Lays out each step's kept probe scores and gathers them from ``scores`` (the step's ``[tokens, columns]``
    buffer; ``None`` where the engine reads no probes)."""

    def __init__(self, scores: torch.Tensor | None) -> None:
        self.scores = scores
        #: This step's runs: ``(request key, probe name, its columns, first token in the step, length)``.
        self.step: list[tuple[str, str, list[int], int, int]] = []
        #: What each request kept so far, by its key: each probe's parts, in position order.
        self.kept: dict[str, dict[str, list[torch.Tensor]]] = {}

    def plan(self, request_ids: Sequence[str], scheduled: np.ndarray, computed: np.ndarray, states: dict) -> None:
        """Lay out the probe scores this step keeps: tokens as vLLM lays them, the input batch's requests in order,
        each its ``scheduled[i]`` tokens at positions ``computed[i]`` onwards."""
        self.step = []
        if self.scores is None:
            return
        offset = 0
        for i, request_id in enumerate(request_ids):
            count = int(scheduled[i])
            wire = (getattr(states[request_id].sampling_params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY)
            if wire is not None:
                columns = dict(wire[PLACED]["probes"])
                for probe in wire["probes"]:
                    form = {"positions": probe["positions"], "prompt_tokens": wire["prompt_tokens"]}
                    for first, _, length in kept_runs(form, int(computed[i]), count):
                        self.step.append((wire["key"], probe["name"], columns[probe["name"]], offset + first, length))
            offset += count

    def gather(self) -> None:
        """Take this step's kept rows and columns out of the scores buffer (one gather on the device, no sync)."""
        if not self.step:
            return
        index = np.concatenate([np.arange(first, first + length) for *_, first, length in self.step])
        rows = self.scores.index_select(0, torch.from_numpy(index).to(self.scores.device, non_blocking=True))
        at = 0
        for key, name, columns, _, length in self.step:
            self.kept.setdefault(key, {}).setdefault(name, []).append(rows[at : at + length, columns])
            at += length
        self.step = []

    def take(self, keys: Sequence[str], packed: bool) -> dict[str, dict[str, Any]]:
        """The scores the requests carrying probe ``keys`` kept (``{key: {probe name: [tokens, classes]}}``, on the
        CPU), handed over and forgotten here; `pack`ed where they leave this process."""
        found = {}
        for key in keys:
            parts = self.kept.pop(key, {})
            found[key] = {name: torch.cat(rows).cpu() for name, rows in parts.items()}
            if packed:
                found[key] = {name: pack(rows) for name, rows in found[key].items()}
        return found


__all__ = ["ProbeReader"]
