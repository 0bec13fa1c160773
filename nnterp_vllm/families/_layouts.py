"""Shared machinery for family modules: the spellings and block layouts several families share.

Not a family itself (its name starts with an underscore, so `known()` skips it).
"""

from __future__ import annotations

from typing import Any

import torch

from ..components import Attention, Layer, Mlp, Value
from ..components import vllm as on_vllm

#: The containers of every model on transformers' llama layout (``model.{embed_tokens, layers, norm}``).
LLAMA_RENAME = {"model.layers": "layers", "model.embed_tokens": "embed_tokens", "model.norm": "norm"}
#: The containers of GPT-2-style models (``transformer.{wte, h, ln_f}``) and their attention's name.
GPT2_RENAME = {
    "transformer.wte": "embed_tokens",
    "transformer.h": "layers",
    "transformer.ln_f": "norm",
    "attn": "self_attn",
}


#: Block norms spelled otherwise than llama's ``input_layernorm`` (the norm before the token mixer) and
#: ``post_attention_layernorm`` (the norm before the MLP): every family's blocks answer to those names
#: too. A family whose module of one of these names is something else maps the name to itself.
BLOCK_NORMS = {
    **dict.fromkeys(("ln_1", "norm_1", "layernorm1", "ln1"), "input_layernorm"),
    **dict.fromkeys(("ln_2", "norm_2", "layernorm2", "ln2"), "post_attention_layernorm"),
    **dict.fromkeys(("self_attn_layer_norm", "attention_layernorm", "attn_norm", "operator_norm"), "input_layernorm"),
    **dict.fromkeys(("temporal_pre_norm", "norm_mlstm"), "input_layernorm"),
    **dict.fromkeys(("feedforward_layernorm", "mlp_norm", "ffn_norm", "pre_ff_layernorm"), "post_attention_layernorm"),
    **dict.fromkeys(("channel_pre_norm", "norm_ffn"), "post_attention_layernorm"),
}


def classes(
    module: str,
    layer: type = Layer,
    attention: type = Attention,
    mlp: type = Mlp,
    mlp_names: dict[str, Any] | None = None,
    **attention_names: Any,
) -> tuple[type, ...]:
    """A family's own ``Layer``, ``Attention`` and ``Mlp``: subclasses of the given bases, owned by ``module``.

    ``attention_names`` set the Attention's operation and module names (``OUTPUT_PROJECTION="dense"``);
    ``mlp_names`` the Mlp's (``{"ROUTER": "gate"}`` on a mixture of experts).
    """
    made = []
    names = {"Attention": attention_names, "Mlp": mlp_names or {}}
    # Named as the module binds them (``Layer, Attention, Mlp = classes(...)``), so pickle finds them.
    for role, base in (("Layer", layer), ("Attention", attention), ("Mlp", mlp)):
        namespace = {"__module__": module, "__qualname__": role, **names.get(role, {})}
        made.append(type(role, (base,), namespace))
    return tuple(made)


class PostNormLayer(Layer):
    """A block that norms each sublayer's output before adding it (Gemma-2/3, OLMo-2).

    The norms' outputs are what the block adds to the residual stream.
    """

    attention_output = Value("post_attention_layernorm.output", description=Layer.attention_output.description)
    mlp_output = Value("post_feedforward_layernorm.output", description=Layer.mlp_output.description)


class PostNormVLLMLayer(on_vllm.DualStreamLayer):
    """`PostNormLayer` on vLLM's module tree."""

    attention_output = on_vllm.Flat("post_attention_layernorm.output", description=Layer.attention_output.description)
    mlp_output = on_vllm.Flat("post_feedforward_layernorm.output", description=Layer.mlp_output.description)


def vllm_classes(
    module: str,
    layer: type = on_vllm.DualStreamLayer,
    attention: type = on_vllm.Attention,
    mlp: type = on_vllm.Mlp,
) -> tuple:
    """A vLLM family's own ``Layer``, ``Attention`` and ``Mlp`` (llama-like dense blocks unless told otherwise)."""
    return classes(module, layer=layer, attention=attention, mlp=mlp)


def softcap(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """``post_head`` for a model that soft-caps its logits (``config.final_logit_softcapping``)."""
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits
