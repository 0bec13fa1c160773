"""Ground truth from plain transformers and PyTorch hooks, independent of nnsight and of the library."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import tiny
import torch
from transformers import AutoModelForCausalLM

PROMPT = "The quick brown fox jumps over"
OTHER_PROMPT = "Hello world"


def load(path: Path, attn_implementation: str = "eager") -> Any:
    """The plain transformers model of a checkpoint, in eval mode."""
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn_implementation).eval()


def encode(prompt: str = PROMPT) -> dict[str, torch.Tensor]:
    return dict(tiny.tokenizer()(prompt, return_tensors="pt"))


def blocks(model: Any) -> torch.nn.ModuleList:
    """The decoder blocks of a plain transformers model, found by type (the longest ModuleList of blocks)."""
    lists = [
        m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == model.config.num_hidden_layers
    ]
    return lists[0]


def run(model: Any, prompt: str = PROMPT, **kwargs: Any) -> Any:
    with torch.no_grad():
        return model(**encode(prompt), **kwargs)


def with_block_output(model: Any, layer: int | str, edit: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    """Run the model with block ``layer``'s hidden output replaced by ``edit(block_input, block_output)``.

    ``layer`` is an index into `blocks`, or the block module's path in the plain model. A model that runs
    its blocks over positions of its own before the prompt's (learned prompt tokens) is edited at the
    prompt's positions, the trailing ones.
    """
    tokens = encode()["input_ids"].shape[1]

    def at_prompt(hidden_in: torch.Tensor, hidden_out: torch.Tensor) -> torch.Tensor:
        if hidden_out.shape[1] == tokens:
            return edit(hidden_in, hidden_out)
        hidden_out = hidden_out.clone()
        hidden_out[:, -tokens:] = edit(hidden_in[:, -tokens:], hidden_out[:, -tokens:])
        return hidden_out

    def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        hidden_in = args[0] if args else next(iter(kwargs.values()))
        if isinstance(output, (tuple, list)):
            return type(output)([at_prompt(hidden_in, output[0]), *output[1:]])
        return at_prompt(hidden_in, output)

    block = model.get_submodule(layer) if isinstance(layer, str) else blocks(model)[layer]
    handle = block.register_forward_hook(hook, with_kwargs=True)
    try:
        return run(model).logits
    finally:
        handle.remove()


def output_of(model: Any, path: str) -> Any:
    """What module ``path`` of a plain model returns on `PROMPT`."""
    seen: list[Any] = []
    handle = model.get_submodule(path).register_forward_hook(lambda module, args, output: seen.append(output))
    try:
        run(model)
    finally:
        handle.remove()
    return seen[0]


def inputs_of(model: Any, path: str) -> tuple:
    """The positional arguments module ``path`` of a plain model is called with on `PROMPT`."""
    seen: list[tuple] = []
    handle = model.get_submodule(path).register_forward_pre_hook(lambda module, args: seen.append(args))
    try:
        run(model)
    finally:
        handle.remove()
    return seen[0]


def block_outputs(model: Any, input_ids: list[int], layers: list[int]) -> dict[int, torch.Tensor]:
    """The stream leaving each of ``layers`` (`blocks`' indices) of a plain model on ``input_ids``: ``[seq, hidden]``
    each, read by forward hooks."""
    seen: dict[int, torch.Tensor] = {}

    def keep(layer: int) -> Callable:
        def hook(module: Any, args: tuple, output: Any) -> None:
            seen.setdefault(layer, first_output(output)[0])

        return hook

    handles = [blocks(model)[layer].register_forward_hook(keep(layer)) for layer in layers]
    try:
        with torch.no_grad():
            model(torch.tensor([input_ids]))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def first_output(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def with_input_edit(model: Any, path: str, position: int, edit: Callable[[Any], Any]) -> Any:
    """The logits with positional argument ``position`` of module ``path`` replaced by ``edit(argument)``."""

    def hook(module: Any, args: tuple) -> tuple:
        args = list(args)
        args[position] = edit(args[position])
        return tuple(args)

    handle = model.get_submodule(path).register_forward_pre_hook(hook)
    try:
        return run(model).logits
    finally:
        handle.remove()


def saelens_sae(
    directory: Path,
    architecture: str,
    hook: str,
    d_in: int,
    d_sae: int = 64,
    seed: int = 0,
    stream_scale: float = 1.0,
    **cfg: Any,
):
    """A SAELens SAE of ``architecture`` (``"standard"``, ``"jumprelu"``, ``"topk"``) with seeded weights (about
    a tenth of its features active on a stream whose elements are of size ``stream_scale``), saved by SAELens's own
    ``save_model`` into ``directory``; the SAELens object is returned."""
    from sae_lens import JumpReLUSAE, JumpReLUSAEConfig, StandardSAE, StandardSAEConfig, TopKSAE, TopKSAEConfig
    from sae_lens.saes.sae import SAEMetadata

    kinds = {
        "standard": (StandardSAE, StandardSAEConfig),
        "jumprelu": (JumpReLUSAE, JumpReLUSAEConfig),
        "topk": (TopKSAE, TopKSAEConfig),
    }
    sae_class, config_class = kinds[architecture]
    sae = sae_class(config_class(d_in=d_in, d_sae=d_sae, metadata=SAEMetadata(hook_name=hook), **cfg))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in sae.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
        sae.W_enc.div_(d_in**0.5 * stream_scale)
        sae.b_enc.mul_(0.3).sub_(1.2)
        sae.b_dec.mul_(0.1 * stream_scale)
        if architecture == "jumprelu":
            sae.threshold.copy_(torch.rand(d_sae, generator=generator) * 0.5)
    sae.save_model(str(directory))
    return sae.eval()


def intervene(model: Any, layer: int | str, spec: Any, positions: Any = None) -> None:
    """One spec (`Steering`, `Clamp`, `Ablate`, `Cap`) applied at one block in a trace, as the README writes
    each kind."""
    from nnterp_vllm import Ablate, Clamp, Steering

    if isinstance(spec, Steering):
        model.steer(layer, spec.vector, spec.factor, positions=positions)
    elif isinstance(spec, Clamp):
        model.clamp(spec.sae, spec.feature, spec.value, spec.scale, positions=positions)
    elif isinstance(spec, Ablate):
        model.ablate(layer, spec.vector, positions=positions)
    else:
        model.cap(layer, spec.vector, min=spec.min, max=spec.max, positions=positions)


def greedy_with_hooks(
    model: Any, prompt_ids: list[int], handles: list[Any], steps: int
) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generation of ``steps`` tokens after ``prompt_ids`` with the forward hooks of
    ``handles`` in place (removed after): the tokens and the logprob of each."""
    try:
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
    finally:
        for handle in handles:
            handle.remove()
    tokens = generated.sequences[0, len(prompt_ids) :]
    logprobs = torch.stack([torch.log_softmax(step[0].float(), -1)[t] for step, t in zip(generated.logits, tokens)])
    return tokens.tolist(), logprobs
