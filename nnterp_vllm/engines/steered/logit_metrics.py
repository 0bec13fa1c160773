"""Metrics read in the steered engine's worker from the logits of a prompt's last position (`specs.metrics`).

The runner's model computes the logits of each scheduled request's last scheduled token (vLLM's ``compute_logits``,
outside the compiled graph, one row per request of the input batch, in order); at the step in which a request
carrying a metric finishes its prompt, its row is the prompt's last position, and the metric is read from it on the
device (no host sync), kept by the request's metric key until the client takes it (`MetricReader.take`). Under
tensor parallelism only the first rank holds the whole logits, so only it keeps values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...specs.metrics import EXTRA_ARGS_KEY, metric_value


class MetricReader:
    """Reads each metric-carrying request's metric from its prompt's last-position logits (installed on a loaded
    model: its ``compute_logits`` is wrapped)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.planned: list[tuple[int, dict[str, Any]]] = []
        self.values: dict[str, torch.Tensor] = {}
        compute_logits = model.compute_logits

        def read_after(*args: Any, **kwargs: Any) -> Any:
            logits = compute_logits(*args, **kwargs)
            self.read(logits)
            return logits

        model.compute_logits = read_after

    def plan(self, request_ids: Sequence[str], scheduled: np.ndarray, computed: np.ndarray, states: dict) -> None:
        """Which rows of this step's logits are a metric-carrying request's prompt's last position: those whose
        scheduled tokens end its prompt (the input batch's requests in order, one row each)."""
        self.planned = []
        for row, request_id in enumerate(request_ids):
            state = states[request_id]
            wire = (getattr(state.sampling_params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY)
            if wire is not None and int(computed[row]) + int(scheduled[row]) == state.num_prompt_tokens:
                self.planned.append((row, wire))

    def read(self, logits: torch.Tensor | None) -> None:
        """Read the planned rows' metrics from this step's logits (``None`` on a rank that holds none)."""
        if logits is not None:
            for row, wire in self.planned:
                self.values[wire["key"]] = metric_value(logits[row], wire)
        self.planned = []

    def take(self, keys: Sequence[str]) -> dict[str, float]:
        """The values of the requests carrying metric ``keys`` that have been read, handed over and forgotten."""
        return {key: float(self.values.pop(key)) for key in keys if key in self.values}


__all__ = ["MetricReader"]
