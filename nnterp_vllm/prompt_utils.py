"""nnterp's prompts with target tokens: which tokens to track, and their probabilities over many prompts.

`run_prompts` takes either engine's model (each prompt is its own invoke, so it runs on vLLM as on
transformers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .nnsight_utils import compute_next_token_probs

#: The marker `get_first_tokens` puts before a word to see how the tokenizer starts it without a space.
MARKER = "🍐"


class TokenizationError(Exception):
    """A tokenizer that does not split as the first-token rules expect."""


def _tokenizer(llm_or_tokenizer: Any) -> Any:
    """The tokenizer of a model (``model.tokenizer``), or the argument itself where it is a tokenizer."""
    return llm_or_tokenizer if hasattr(llm_or_tokenizer, "convert_ids_to_tokens") else llm_or_tokenizer.tokenizer


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _bare_first_token(tokenizer: Any, word: str) -> int | None:
    """The first token of ``word`` where it continues other text without a space (``None`` for an empty word).

    The word follows `MARKER`, whose tokens are then dropped, so a tokenizer that adds a prefix space
    at the start of a text (SentencePiece's) does not turn the word into its spaced form.
    """
    marker = _ids(tokenizer, MARKER)
    tokens = _ids(tokenizer, MARKER + word)
    if tokens[: len(marker)] != marker:
        raise TokenizationError(f"the tokenizer merges {MARKER!r} with the start of {word!r}")
    return tokens[len(marker)] if len(tokens) > len(marker) else None


def get_first_tokens(
    words: str | list[str], llm_or_tokenizer: Any, use_hacky_implementation: bool = False
) -> list[int]:
    """The first token of each word written without and with a leading space (``"word"``, ``" word"``), deduplicated.

    A spaced form whose first token is the space alone (a tokenizer splitting spaces off) adds nothing.
    ``use_hacky_implementation`` (nnterp's switch between two ways of finding the unspaced form) is
    accepted; the unspaced form is always found after a marker character.
    """
    tokenizer = _tokenizer(llm_or_tokenizer)
    words = [words] if isinstance(words, str) else list(words)
    space = _ids(tokenizer, " ")
    space_token = space[0] if space else None
    tokens: list[int] = []
    for word in words:
        bare = _bare_first_token(tokenizer, word)
        if bare is not None:
            tokens.append(bare)
        spaced = _ids(tokenizer, " " + word)
        if spaced and spaced[0] != space_token:
            tokens.append(spaced[0])
    return list(dict.fromkeys(tokens))


@dataclass
class Prompt:
    """A prompt and the target tokens whose next-token probabilities are tracked, by target name."""

    prompt: str
    target_tokens: dict[str, list[int]]
    target_strings: dict[str, str | list[str]] | None = None

    @classmethod
    def from_strings(
        cls, prompt: str, target_strings: dict[str, str | list[str]] | list[str] | str, tokenizer: Any
    ) -> Prompt:
        """A prompt whose targets are words (one target named ``"target"`` unless a dict names them);
        each target tracks the words' `get_first_tokens`."""
        if isinstance(target_strings, (str, list)):
            target_strings = {"target": target_strings}
        target_tokens = {target: get_first_tokens(words, tokenizer) for target, words in target_strings.items()}
        return cls(prompt=prompt, target_tokens=target_tokens, target_strings=target_strings)

    def has_no_collisions(self, ignore_targets: None | str | list[str] = None) -> bool:
        """Whether no token is tracked by two targets (leaving out ``ignore_targets``)."""
        ignored = [ignore_targets] if isinstance(ignore_targets, str) else ignore_targets or []
        tracked = [token for target, tokens in self.target_tokens.items() if target not in ignored for token in tokens]
        return len(tracked) == len(set(tracked))

    def get_target_probs(self, probs: torch.Tensor, layer: int | None = None) -> dict[str, torch.Tensor]:
        """Each target's summed probability in ``probs`` (``[batch, layers, vocab]``): ``[batch, layers]``,
        or ``[batch]`` at ``layer``."""
        summed = {target: probs[:, :, tokens].sum(dim=2).cpu() for target, tokens in self.target_tokens.items()}
        return summed if layer is None else {target: values[:, layer] for target, values in summed.items()}

    def run(self, nn_model: Any, get_probs: Callable[[Any, str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """``get_probs(model, prompt)`` (``[1, layers, vocab]``) reduced to each target's probability."""
        with torch.no_grad():
            return self.get_target_probs(get_probs(nn_model, self.prompt))


def next_token_probs_unsqueeze(nn_model: Any, prompt: str | list[str], remote: bool = False, **_: Any) -> torch.Tensor:
    """The next-token probabilities with a layer axis of one: ``[prompts, 1, vocab]``."""
    return compute_next_token_probs(nn_model, prompt, remote=remote).unsqueeze(1)


def run_prompts(
    nn_model: Any,
    prompts: list[Prompt],
    batch_size: int = 32,
    get_probs_func: Callable | None = None,
    func_kwargs: dict | None = None,
    remote: bool = False,
    tqdm: Callable | None = None,
) -> dict[str, torch.Tensor]:
    """Each target's probability over ``prompts``, in batches: ``{target: [prompts, layers]}``.

    ``get_probs_func(model, batch, remote=..., **func_kwargs)`` gives ``[batch, layers, vocab]``
    (the next-token probabilities by default); every prompt must have the same targets. ``tqdm``
    wraps the batches (none by default).
    """
    if not prompts:
        return {}
    keys = set(prompts[0].target_tokens)
    for prompt in prompts:
        if set(prompt.target_tokens) != keys:
            raise ValueError(f"All prompts must have the same target keys. Got {keys} and {set(prompt.target_tokens)}")
    get_probs_func = get_probs_func or next_token_probs_unsqueeze
    starts = range(0, len(prompts), batch_size)
    with torch.no_grad():
        probs = torch.cat(
            [
                get_probs_func(
                    nn_model,
                    [p.prompt for p in prompts[start : start + batch_size]],
                    remote=remote,
                    **(func_kwargs or {}),
                )
                for start in (tqdm(starts, desc="Running prompts") if tqdm is not None else starts)
            ]
        )
    return {
        target: torch.stack(
            [probs[i, :, prompt.target_tokens[target]].sum(dim=1) for i, prompt in enumerate(prompts)]
        ).cpu()
        for target in prompts[0].target_tokens
    }
