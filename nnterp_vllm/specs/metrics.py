"""Metrics of the next token, read from the logits at a prompt's last position: one number per request, computed
where the logits are (the steered engine's worker, or transformers' model), never the logits themselves.

`LogitDiff` (the correct token's logit minus the wrong one's), `Logprob` (a token's log-probability) and
`Recovered` (the fraction of the clean-minus-corrupt difference of another metric that a patched run restores,
computed from that metric's values: `patch_sweep` takes it). A token is an id, or a string the model's tokenizer
encodes as exactly one token; each is checked against the vocabulary before any request runs. What travels to the
engine is `metric_wire`'s plain form, read back by `metric_value`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import arguments

#: The key of ``SamplingParams.extra_args`` under which a request's metric travels to the engine.
EXTRA_ARGS_KEY = "nnterp_vllm_metric"


@dataclass(frozen=True)
class LogitDiff:
    """The logit of ``correct`` minus that of ``wrong`` at the prompt's last position (each a token id or a string
    that is one token)."""

    correct: int | str
    wrong: int | str

    @property
    def tokens(self) -> tuple[int | str, ...]:
        """The tokens it reads, in order."""
        return (self.correct, self.wrong)

    @property
    def name(self) -> str:
        """How a table names it."""
        return "logit_diff"


@dataclass(frozen=True)
class Logprob:
    """The log-probability of ``token`` (an id or a string that is one token) at the prompt's last position."""

    token: int | str

    @property
    def tokens(self) -> tuple[int | str, ...]:
        """The tokens it reads."""
        return (self.token,)

    @property
    def name(self) -> str:
        """How a table names it."""
        return "logprob"


@dataclass(frozen=True)
class Recovered:
    """The fraction of ``metric``'s clean-minus-corrupt difference a patched run restores: ``(patched - corrupt) /
    (clean - corrupt)`` (1: all of it, 0: none)."""

    metric: LogitDiff | Logprob

    def __post_init__(self) -> None:
        if not isinstance(self.metric, (LogitDiff, Logprob)):
            raise ValueError(
                f"Recovered: metric is a LogitDiff or a Logprob whose difference it measures, got {self.metric!r}"
            )

    @property
    def name(self) -> str:
        """How a table names it."""
        return f"recovered_{self.metric.name}"


METRICS = (LogitDiff, Logprob, Recovered)


def base_metric(metric: Any, what: str = "metric") -> LogitDiff | Logprob:
    """The metric read from the logits: ``metric`` itself, or the one a `Recovered` measures; ``ValueError`` for
    anything else."""
    if isinstance(metric, Recovered):
        return metric.metric
    if isinstance(metric, (LogitDiff, Logprob)):
        return metric
    raise ValueError(f"{what}: a metric is LogitDiff(correct, wrong), Logprob(token) or Recovered(...), got {metric!r}")


def token_id(token: Any, tokenizer: Any, vocab_size: int, what: str) -> int:
    """``token`` (an id, or a string the tokenizer encodes as exactly one token) as an id in the vocabulary."""
    if arguments.is_int(token):
        if not 0 <= token < vocab_size:
            raise ValueError(f"{what}: token {token} is not in the vocabulary (ids 0..{vocab_size - 1})")
        return int(token)
    if isinstance(token, str):
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(
                f"{what}: {token!r} is {len(ids)} tokens ({ids}) for this tokenizer, not one: give a token id or a "
                "string that is one token (often with its leading space)"
            )
        return int(ids[0])
    raise ValueError(f"{what}: a token is an id or a one-token string, got {type(token).__name__}")


def metric_wire(metric: Any, tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """``metric`` (its base metric, `base_metric`) in engine form: a fresh key naming the request's value, its
    kind and its token ids, checked against the vocabulary."""
    base = base_metric(metric)
    tokens = [token_id(token, tokenizer, vocab_size, type(base).__name__) for token in base.tokens]
    return {"key": uuid.uuid4().hex, "kind": base.name, "tokens": tokens}


def metric_value(logits: torch.Tensor, wire: dict[str, Any]) -> torch.Tensor:
    """A metric in engine form read from one position's ``logits`` (``[vocab]``): a 0-d float32 tensor on their
    device (no host sync)."""
    if wire["kind"] == "logit_diff":
        correct, wrong = wire["tokens"]
        return (logits[correct].float() - logits[wrong].float()).reshape(())
    return torch.log_softmax(logits.float(), -1)[wire["tokens"][0]].reshape(())


def per_prompt(metric: Any, count: int) -> list[Any]:
    """``metric`` as ``generate`` takes it for ``count`` prompts: ``None`` or one metric for every prompt, or a list
    with one entry (a metric or ``None``) per prompt."""
    if metric is None or isinstance(metric, METRICS):
        return [metric] * count
    if isinstance(metric, Sequence) and not isinstance(metric, str):
        if len(metric) != count:
            raise ValueError(f"metric: {len(metric)} entries for {count} prompts; give one metric or one per prompt")
        for index, entry in enumerate(metric):
            if entry is not None and not isinstance(entry, METRICS):
                raise ValueError(f"metric[{index}]: a metric is LogitDiff, Logprob or Recovered, got {entry!r}")
        return list(metric)
    raise ValueError(f"metric: a metric is LogitDiff, Logprob or Recovered (or a list of them), got {metric!r}")


__all__ = ["LogitDiff", "Logprob", "Recovered", "base_metric", "metric_value", "metric_wire", "token_id"]
