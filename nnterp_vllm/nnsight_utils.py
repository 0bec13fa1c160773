"""nnterp's nnsight helpers: the standardized values by function, and activation collection over prompts.

Every helper takes either engine's model (`StandardizedTransformer`, `StandardizedVLLM`) and reads it
through its public values (``model.layers_output[i]``, ``model.next_token_probs``, ...), so it runs on
vLLM as on transformers. As nnterp's did, they also take a plain nnsight model on transformers' llama
layout (``model.model.layers``), whose native module outputs they read. Over several prompts each
prompt is its own invoke (vLLM serves one prompt per invoke; transformers batches the invokes, padded
on the tokenizer's side). A helper's ``remote=`` goes to each trace it runs, as in nnsight: ``"local"`` is
the dry run of sending it (`remote`), ``True`` or a host URL sends it to NDIF.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from nnsight.intervention.envoy import Envoy

from . import families
from .components import first_tensor
from .families._layouts import LLAMA_RENAME
from .nnterp_options import RenameConfig
from .standardized import Standardized, standard_rename

#: ``get_activations=`` functions: ``(model, layer) -> value``.
GetModuleOutput = Callable[[Any, int], Any]

#: Where a plain nnsight model on transformers' llama layout keeps each standard module.
LLAMA_PATHS = {standard: native for native, standard in LLAMA_RENAME.items()}


def is_standardized(model: Any) -> bool:
    """Whether ``model`` is either engine's standardized model (else a plain nnsight model)."""
    return isinstance(model, Standardized)


def _llama(model: Any, standard: str) -> Envoy:
    """A plain nnsight model's module of that standard name, where transformers' llama layout keeps it."""
    node = model
    for part in LLAMA_PATHS[standard].split("."):
        node = getattr(node, part)
    return node


def get_embed_tokens(model: Any) -> Envoy:
    """The token embedding module."""
    return model.embed_tokens if is_standardized(model) else _llama(model, "embed_tokens")


def get_layers(model: Any) -> Envoy:
    """The blocks of the model."""
    return model.layers if is_standardized(model) else _llama(model, "layers")


def get_num_layers(model: Any) -> int:
    """The number of blocks."""
    return len(get_layers(model))


def get_layer(model: Any, layer: int) -> Envoy:
    """Block ``layer``."""
    return get_layers(model)[layer]


def get_layer_input(model: Any, layer: int) -> Any:
    """The residual stream entering block ``layer``."""
    return model.layers_input[layer] if is_standardized(model) else get_layer(model, layer).input


def get_layer_output(model: Any, layer: int) -> Any:
    """The residual stream leaving block ``layer``."""
    return model.layers_output[layer] if is_standardized(model) else first_tensor(get_layer(model, layer).output)


def set_layer_output(model: Any, layer: int, tensor: Any) -> None:
    """Replace the residual stream leaving block ``layer`` with ``tensor``."""
    if is_standardized(model):
        model.layers_output[layer] = tensor
        return
    block = get_layer(model, layer)
    output = block.output
    block.output = (tensor, *output[1:]) if isinstance(output, tuple) else tensor


def get_attention(model: Any, layer: int) -> Envoy:
    """The attention module of block ``layer``."""
    return get_layer(model, layer).self_attn


def get_attention_input(model: Any, layer: int) -> Any:
    """The hidden states the attention module of block ``layer`` reads."""
    return model.attentions_input[layer] if is_standardized(model) else get_attention(model, layer).input


def get_attention_output(model: Any, layer: int) -> Any:
    """What the attention sublayer of block ``layer`` adds to the residual stream."""
    if is_standardized(model):
        return model.attentions_output[layer]
    return first_tensor(get_attention(model, layer).output)


def get_mlp(model: Any, layer: int) -> Envoy:
    """The MLP module of block ``layer``."""
    return get_layer(model, layer).mlp


def get_mlp_output(model: Any, layer: int) -> Any:
    """What the MLP of block ``layer`` adds to the residual stream."""
    return model.mlps_output[layer] if is_standardized(model) else first_tensor(get_mlp(model, layer).output)


def get_logits(model: Any) -> Any:
    """The logits ``[batch, seq, vocab]``."""
    return model.logits if is_standardized(model) else model.output.logits


def get_unembed_norm(model: Any) -> Envoy:
    """The final norm."""
    return model.ln_final if is_standardized(model) else _llama(model, "norm")


def get_unembed(model: Any) -> Envoy:
    """The head projecting onto the vocabulary."""
    return model.lm_head


def project_on_vocab(model: Any, hidden: Any) -> Any:
    """Logits for residual-stream states: the final norm and the head (and any post-head step of the family)."""
    if is_standardized(model):
        return model.project_on_vocab(hidden)
    return get_unembed(model)(get_unembed_norm(model)(hidden))


def get_next_token_probs(model: Any) -> Any:
    """The softmax of the last position's logits ``[batch, vocab]``."""
    return model.next_token_probs if is_standardized(model) else get_logits(model)[:, -1, :].softmax(-1)


def prompt_list(prompts: Any, what: str) -> list:
    """``prompts`` as a list of prompts: one string, token-id list, tensor or tokenizer output is a list of one."""
    if isinstance(prompts, (str, torch.Tensor, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts:
        return list(prompts)
    raise ValueError(f"{what}: give a prompt or a non-empty list of prompts, got {prompts!r:.60}")


def saved(value: Any) -> Any:
    """``value`` saved out of the trace (each element of a tuple)."""
    return tuple(part.save() for part in value) if isinstance(value, tuple) else value.save()


def each_prompt(model: Any, prompts: list, read: Callable[[int], Any], **trace_kwargs: Any) -> list:
    """``read(i)`` inside the invoke of prompt ``i``, for every prompt, in one trace: the saved results in order."""
    results: list = []
    with model.trace(**trace_kwargs) as tracer:
        for index, prompt in enumerate(prompts):
            with tracer.invoke(prompt):
                results.append(saved(read(index)))
    return results


def layer_list(model: Any, layers: int | Sequence[int] | None) -> list[int]:
    """``layers`` (an int, ints, or ``None`` for all) as a list of indices, negative ones counted from the end."""
    count = get_num_layers(model)
    chosen = list(range(count)) if layers is None else [layers] if isinstance(layers, int) else list(layers)
    bad = [layer for layer in chosen if not isinstance(layer, int) or not -count <= layer < count]
    if not chosen or bad:
        raise ValueError(f"layers {bad or chosen} do not exist; the model has num_layers={count} (0..{count - 1})")
    return [layer % count for layer in chosen]


def _check_index(model: Any, idx: int, what: str) -> None:
    """nnterp's rule for an index over padded prompts: negative needs left padding, positive right padding."""
    if is_standardized(model) and model.ENGINE == families.VLLM:
        return  # vLLM runs every prompt unpadded
    side = model.tokenizer.padding_side
    if (idx < 0 and side != "left") or (idx > 0 and side != "right"):
        needed = "left" if idx < 0 else "right"
        raise ValueError(
            f"{what}: idx={idx} counts from the {'end' if idx < 0 else 'start'} of each prompt, which needs "
            f"{needed} padding over a batch; the tokenizer pads on the {side!r} side "
            f"(set model.tokenizer.padding_side = {needed!r})"
        )


def read_at(model: Any, layers: list[int], get_activations: GetModuleOutput, idx: int) -> torch.Tensor:
    """``get_activations(model, layer)[:, idx]`` for ``layers``, read in forward order: ``[layers, batch, ...]``."""
    read = {layer: get_activations(model, layer)[:, idx] for layer in sorted(set(layers))}
    return torch.stack([read[layer] for layer in layers])


def get_token_activations(
    nn_model: Any,
    prompts: Any = None,
    layers: int | Sequence[int] | None = None,
    get_activations: GetModuleOutput | None = None,
    remote: bool = False,
    idx: int | None = None,
    tracer: Any = None,
) -> torch.Tensor:
    """Each prompt's activation at token ``idx`` (the last by default) at each layer: ``[layers, prompts, hidden]``.

    ``get_activations(model, layer)`` says which value (the block's output by default). With ``tracer``
    (inside an open trace, ``prompts`` unused) the values of the current invoke are returned, unsaved.
    """
    if tracer is None and prompts is None:
        raise ValueError("get_token_activations: give prompts, or call it inside a trace with tracer=")
    get_activations = get_activations or get_layer_output
    idx = -1 if idx is None else idx
    _check_index(nn_model, idx, "get_token_activations")
    layers = layer_list(nn_model, layers)
    if tracer is not None:
        return read_at(nn_model, layers, get_activations, idx)
    with torch.no_grad():
        rows = each_prompt(
            nn_model,
            prompt_list(prompts, "get_token_activations"),
            lambda _: read_at(nn_model, layers, get_activations, idx),
            remote=remote,
        )
    return torch.cat(rows, dim=1).cpu()


def collect_token_activations_batched(
    nn_model: Any,
    prompts: Sequence[Any],
    batch_size: int,
    layers: int | Sequence[int] | None = None,
    get_activations: GetModuleOutput | None = None,
    remote: bool = False,
    idx: int | None = None,
    tqdm: Callable | None = None,
    use_session: bool = True,
) -> torch.Tensor:
    """`get_token_activations` over ``prompts`` in batches of ``batch_size``: ``[layers, prompts, hidden]``.

    ``use_session`` (nnterp's NDIF round-trip option) changes nothing when running locally.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"collect_token_activations_batched: batch_size must be a positive int, got {batch_size!r}")
    starts = range(0, len(prompts), batch_size)
    batches = [
        get_token_activations(nn_model, list(prompts[start : start + batch_size]), layers, get_activations, remote, idx)
        for start in (tqdm(starts) if tqdm is not None else starts)
    ]
    return torch.cat(batches, dim=1)


#: nnterp's session spelling of `collect_token_activations_batched` (a session only saves NDIF round trips).
collect_last_token_activations_session = collect_token_activations_batched


def compute_next_token_probs(nn_model: Any, prompt: Any, remote: bool = False) -> torch.Tensor:
    """The next-token probabilities of each prompt: ``[prompts, vocab]``."""
    with torch.no_grad():
        rows = each_prompt(
            nn_model,
            prompt_list(prompt, "compute_next_token_probs"),
            lambda _: get_next_token_probs(nn_model),
            remote=remote,
        )
    return torch.cat(rows).cpu()


class ModuleAccessor:
    """A loaded transformers model's modules by their standard names (``get_layers()``, ``get_attention(i)``, ...).

    The names are the ones a standardized model of the same family answers to; ``rename_config`` and
    ``rename`` add names, as they do for `StandardizedTransformer`. Attributes are the ``torch.nn.Module``
    objects themselves.
    """

    def __init__(
        self, model: torch.nn.Module, rename_config: RenameConfig | None = None, rename: dict[str, str] | None = None
    ) -> None:
        from nnsight import NNsight

        family = families.lookup(families.model_type(model.config))
        extra = {**(rename_config.rename() if rename_config is not None else {}), **(rename or {})}
        self.nn_model = NNsight(model, rename=standard_rename(family, extra))

    def __getattr__(self, name: str) -> torch.nn.Module:
        if name == "nn_model":
            raise AttributeError(name)
        attribute = getattr(self.nn_model, name)
        if not hasattr(attribute, "_module"):
            raise AttributeError(f"Attribute {name} is not a module")
        return attribute._module

    def get_embed_tokens(self) -> torch.nn.Module:
        """The token embedding module."""
        return self.nn_model.embed_tokens._module

    def get_layers(self) -> torch.nn.ModuleList:
        """The blocks."""
        return self.nn_model.layers._module

    def get_attention(self, layer: int) -> torch.nn.Module:
        """Block ``layer``'s attention module."""
        return self.nn_model.layers[layer].self_attn._module

    def get_mlp(self, layer: int) -> torch.nn.Module:
        """Block ``layer``'s MLP module."""
        return self.nn_model.layers[layer].mlp._module

    def get_unembed_norm(self) -> torch.nn.Module:
        """The final norm."""
        return self.nn_model.ln_final._module

    def get_unembed(self) -> torch.nn.Module:
        """The head projecting onto the vocabulary."""
        return self.nn_model.lm_head._module
