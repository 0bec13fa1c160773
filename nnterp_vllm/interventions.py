"""nnterp's interventions: the logit lens, patchscopes, and the object-attention lens, on either engine.

Each function takes a standardized model (or, as nnterp's did, a plain nnsight model on transformers'
llama layout) and runs each prompt as its own invoke, so it runs on vLLM as on transformers. Results
are on the CPU. Arguments are checked, and values the model cannot serve are refused with
`UnavailableValue` and the reason, before anything runs. ``remote=`` goes to every trace a function runs
(`nnsight_utils`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import UnavailableValue
from .nnsight_utils import (
    each_prompt,
    get_attention_input,
    get_layer_output,
    get_next_token_probs,
    get_num_layers,
    get_token_activations,
    get_unembed,
    get_unembed_norm,
    is_standardized,
    layer_list,
    project_on_vocab,
    prompt_list,
    read_at,
)

__all__ = [
    "TargetPrompt",
    "TargetPromptBatch",
    "it_repeat_prompt",
    "logit_lens",
    "patch_object_attn_lens",
    "patchscope_generate",
    "patchscope_lens",
    "repeat_prompt",
]


def _inverse_projection(model: Any, hidden: Any) -> Any:
    """nnterp's inverse lens: the head applied to the negated final-norm output of ``hidden``."""
    if is_standardized(model):
        return model._post_head(model._unembed(-model._final_norm(hidden)))
    return get_unembed(model)(-get_unembed_norm(model)(hidden))


def logit_lens(
    nn_model: Any, prompts: Any, remote: bool = False, return_inv_logits: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Next-token probabilities read off every block's output at each prompt's last token: ``[prompts, layers, vocab]``.

    With ``return_inv_logits`` also those of the negated normed states (nnterp's inverse lens), as a pair.
    """
    prompts = prompt_list(prompts, "logit_lens")
    layers = list(range(get_num_layers(nn_model)))

    def lens(_: int) -> Any:
        hiddens = read_at(nn_model, layers, get_layer_output, -1)
        probabilities = torch.stack([project_on_vocab(nn_model, h).softmax(-1) for h in hiddens], dim=1)
        if not return_inv_logits:
            return probabilities
        inverse = torch.stack([_inverse_projection(nn_model, h).softmax(-1) for h in hiddens], dim=1)
        return probabilities, inverse

    with torch.no_grad():
        rows = each_prompt(nn_model, prompts, lens, remote=remote)
    if return_inv_logits:
        return torch.cat([row[0] for row in rows]).cpu(), torch.cat([row[1] for row in rows]).cpu()
    return torch.cat(rows).cpu()


@dataclass
class TargetPrompt:
    """A prompt to patch, and the position of the token whose hidden state is replaced."""

    prompt: str
    index_to_patch: int


def repeat_prompt(
    words: Sequence[str] | None = None,
    rel: str = " ",
    sep: str = "\n",
    placeholder: str = "?",
    index_to_patch: int = -1,
) -> TargetPrompt:
    """The patchscopes paper's next-token target prompt: ``"king king\\n1135 1135\\nhello hello\\n?"``.

    Each of ``words`` is repeated around ``rel``, the pairs joined by ``sep``, then ``placeholder``,
    whose token (``index_to_patch``, the last by default) is patched.
    """
    words = ["king", "1135", "hello"] if words is None else list(words)
    return TargetPrompt(sep.join(word + rel + word for word in words) + sep + placeholder, index_to_patch)


def it_repeat_prompt(
    tokenizer: Any,
    words: Sequence[str] | None = None,
    rel: str = " ",
    sep: str = "\n",
    placeholder: str = "?",
    complete_prompt: bool = True,
    add_user_instr: bool = True,
    use_system_prompt: bool = True,
) -> TargetPrompt:
    """`repeat_prompt` in the tokenizer's chat template, for instruction-tuned models; the last token is patched.

    ``add_user_instr`` asks the model, as the user, to guess the next word (else the instruction is the
    system's, or part of the user's message without a system prompt); ``complete_prompt`` makes the
    assistant's turn start with the repeated sequence.
    """
    prompt = repeat_prompt(words, rel, sep, placeholder).prompt
    reply = {"role": "assistant", "content": prompt if complete_prompt else ""}
    system = [{"role": "system", "content": "You are a helpful assistant."}] if use_system_prompt else []
    if add_user_instr:
        instruction = (
            "I will provide you with a series of sentences. Your task is to guess the next word in the "
            "sentence. You must answer with the next word only."
        )
        chat = [
            *system,
            {"role": "user", "content": instruction},
            {"role": "assistant", "content": "Ok."},
            {"role": "user", "content": prompt},
        ]
    elif use_system_prompt:
        instruction = (
            "The user will provide you with a sentence. Your task is to guess the next word in the sentence. "
            "You must answer with the next word only."
        )
        chat = [{"role": "system", "content": instruction}, {"role": "user", "content": prompt}]
    else:
        chat = [
            {
                "role": "user",
                "content": f"Guess the next word in the following sentence (answer only the next word): {prompt}",
            }
        ]
    text = tokenizer.apply_chat_template(
        [*chat, reply], tokenize=False, continue_final_message=True, add_special_tokens=False
    )
    return TargetPrompt(text, -1)


@dataclass
class TargetPromptBatch:
    """Several target prompts, each with its own position to patch."""

    prompts: list[str]
    index_to_patch: torch.Tensor

    @classmethod
    def from_target_prompts(cls, prompts: Sequence[TargetPrompt]) -> TargetPromptBatch:
        """A batch of the given target prompts."""
        return cls([p.prompt for p in prompts], torch.tensor([p.index_to_patch for p in prompts]))

    @classmethod
    def from_target_prompt(cls, prompt: TargetPrompt, batch_size: int) -> TargetPromptBatch:
        """``batch_size`` copies of one target prompt."""
        return cls.from_target_prompts([prompt] * batch_size)

    @classmethod
    def from_prompts(
        cls, prompts: str | list[str], index_to_patch: int | list[int] | torch.Tensor
    ) -> TargetPromptBatch:
        """Prompts and their positions to patch (one int for all, or one per prompt)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if isinstance(index_to_patch, int):
            index_to_patch = [index_to_patch] * len(prompts)
        if isinstance(index_to_patch, list):
            index_to_patch = torch.tensor(index_to_patch)
        if not isinstance(index_to_patch, torch.Tensor):
            raise ValueError(
                f"index_to_patch must be an int, a list of ints or a tensor, got {type(index_to_patch).__name__}"
            )
        return cls(prompts, index_to_patch)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> TargetPrompt:
        return TargetPrompt(self.prompts[index], self.index_to_patch[index])

    def __iter__(self) -> Iterator[TargetPrompt]:
        return (self[index] for index in range(len(self)))

    @staticmethod
    def auto(
        target_prompt: str | TargetPrompt | list[TargetPrompt] | TargetPromptBatch, batch_size: int
    ) -> TargetPromptBatch:
        """A batch from any of the forms the patchscopes take; one prompt is repeated ``batch_size`` times."""
        if isinstance(target_prompt, str):
            target_prompt = TargetPrompt(target_prompt, -1)
        if isinstance(target_prompt, TargetPrompt):
            return TargetPromptBatch.from_target_prompt(target_prompt, batch_size)
        if isinstance(target_prompt, list):
            return TargetPromptBatch.from_target_prompts(target_prompt)
        if isinstance(target_prompt, TargetPromptBatch):
            return target_prompt
        raise ValueError(
            "target prompts must be a str, a TargetPrompt, a list of TargetPrompt or a TargetPromptBatch, "
            f"got {type(target_prompt).__name__}"
        )


def _patch_at(value: Any, position: int, hidden: torch.Tensor) -> None:
    """Write ``hidden`` over ``value`` (``[1, seq, hidden]``) at ``position``."""
    value[:, position] = hidden.to(device=value.device, dtype=value.dtype)


def patchscope_lens(
    nn_model: Any,
    source_prompts: Any = None,
    target_patch_prompts: TargetPromptBatch | list[TargetPrompt] | TargetPrompt | None = None,
    layers: int | Sequence[int] | None = None,
    latents: torch.Tensor | None = None,
    remote: bool = False,
) -> torch.Tensor:
    """Patch each source's last-token state at each layer into its target prompt: ``[sources, layers, vocab]``.

    The state of the last token of each source prompt (or ``latents``, ``[layers, sources, hidden]`` with
    a row per layer of ``layers`` or per layer of the model) replaces, at the same layer's output, the
    target prompt's token ``index_to_patch``; the result is the target's next-token probabilities. The
    default target is `repeat_prompt`.
    """
    if latents is not None and source_prompts is not None:
        raise ValueError("patchscope_lens: give source_prompts or latents, not both")
    if latents is None and source_prompts is None:
        raise ValueError("patchscope_lens: give source_prompts (or latents)")
    layers = layer_list(nn_model, layers)
    if latents is not None:
        count = get_num_layers(nn_model)
        if latents.dim() != 3 or latents.shape[0] not in (len(layers), count):
            raise ValueError(
                f"patchscope_lens: latents must be [layers, sources, hidden] with a row per patched layer "
                f"({len(layers)}) or per layer of the model ({count}), got {list(latents.shape)}"
            )
        if latents.shape[0] != len(layers):
            latents = latents[layers]
        num_sources = latents.shape[1]
    else:
        source_prompts = prompt_list(source_prompts, "patchscope_lens")
        num_sources = len(source_prompts)
    targets = TargetPromptBatch.auto(
        repeat_prompt() if target_patch_prompts is None else target_patch_prompts, num_sources
    )
    if len(targets) != num_sources:
        raise ValueError(f"patchscope_lens: {num_sources} sources need as many target prompts, got {len(targets)}")
    if latents is None:
        latents = get_token_activations(nn_model, source_prompts, layers=layers, remote=remote)
    per_layer = []
    with torch.no_grad():
        for row, layer in enumerate(layers):

            def patched(index: int, row: int = row, layer: int = layer) -> Any:
                _patch_at(get_layer_output(nn_model, layer), int(targets.index_to_patch[index]), latents[row][index])
                return get_next_token_probs(nn_model)

            per_layer.append(torch.cat(each_prompt(nn_model, targets.prompts, patched, remote=remote)).cpu())
    return torch.stack(per_layer, dim=1)


def patchscope_generate(
    nn_model: Any,
    prompts: Any,
    target_patch_prompt: TargetPrompt,
    max_length: int = 50,
    layers: int | Sequence[int] | None = None,
    remote: bool = False,
    max_batch_size: int = 32,
) -> dict[int, torch.Tensor]:
    """Generate from the target prompt with each prompt's last-token state patched in, per layer.

    Returns ``{layer: [prompts, target_tokens + max_length]}``: the target prompt's tokens (as its
    invoke holds them) followed by ``max_length`` greedy tokens. The patch is made on the prompt's
    forward pass; at most ``max_batch_size`` generations run together.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"patchscope_generate: max_length must be a positive int, got {max_length!r}")
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"patchscope_generate: max_batch_size must be a positive int, got {max_batch_size!r}")
    prompts = prompt_list(prompts, "patchscope_generate")
    layers = layer_list(nn_model, layers)
    hiddens = get_token_activations(nn_model, prompts, layers=layers, remote=remote)
    jobs = [(row, index) for row in range(len(layers)) for index in range(len(prompts))]
    tokens: dict[tuple[int, int], Any] = {}
    steps: dict[tuple[int, int, int], Any] = {}
    with torch.no_grad():
        for start in range(0, len(jobs), max_batch_size):
            chunk = jobs[start : start + max_batch_size]
            with nn_model.generate(
                max_new_tokens=max_length, min_new_tokens=max_length, do_sample=False, remote=remote
            ) as tracer:
                for row, index in chunk:
                    with tracer.invoke(target_patch_prompt.prompt):
                        tokens[row, index] = nn_model.input_ids.save()
                        for step in tracer.iter[:max_length]:
                            if step == 0:
                                stream = get_layer_output(nn_model, layers[row])
                                _patch_at(stream, target_patch_prompt.index_to_patch, hiddens[row][index])
                            steps[row, index, step] = get_next_token_probs(nn_model).argmax(dim=-1).save()
    return {
        layer: torch.stack(
            [
                torch.cat([tokens[row, index][0], torch.stack([steps[row, index, s][0] for s in range(max_length)])])
                for index in range(len(prompts))
            ]
        ).cpu()
        for row, layer in enumerate(layers)
    }


def patch_object_attn_lens(
    nn_model: Any, source_prompts: Any, target_prompts: Any, attn_idx_patch: int, num_patches: int = 5
) -> torch.Tensor:
    """Make the targets' attention see the sources' last token in place of token ``attn_idx_patch``.

    For each layer ``l``, the hidden states the attention modules of layers ``l..l+num_patches-1``
    read at ``attn_idx_patch`` are replaced by the source's (one source for all targets, or one per
    target) at its last token; the result is each target's next-token probabilities per starting
    layer, ``[targets, layers, vocab]``.
    """
    sources = prompt_list(source_prompts, "patch_object_attn_lens")
    targets = prompt_list(target_prompts, "patch_object_attn_lens")
    if len(sources) not in (1, len(targets)):
        raise ValueError(
            f"patch_object_attn_lens: give one source prompt, or one per target ({len(targets)}), got {len(sources)}"
        )
    if isinstance(num_patches, bool) or not isinstance(num_patches, int) or num_patches < 1:
        raise ValueError(f"patch_object_attn_lens: num_patches must be a positive int, got {num_patches!r}")
    if is_standardized(nn_model):
        reason = nn_model.support().get("self_attn.attention_input", "this model has no attention modules")
        if reason is not None:
            raise UnavailableValue(f"patch_object_attn_lens needs the attention modules' input: {reason}")
    count = get_num_layers(nn_model)
    source_hiddens = get_token_activations(nn_model, sources, get_activations=get_attention_input)
    per_layer = []
    with torch.no_grad():
        for layer in range(count):

            def patched(index: int, layer: int = layer) -> Any:
                source = index if len(sources) > 1 else 0
                for patched_layer in range(layer, min(count, layer + num_patches)):
                    _patch_at(
                        get_attention_input(nn_model, patched_layer),
                        attn_idx_patch,
                        source_hiddens[patched_layer][source],
                    )
                return get_next_token_probs(nn_model)

            per_layer.append(torch.cat(each_prompt(nn_model, targets, patched)).cpu())
    return torch.stack(per_layer, dim=1)
