"""Shared machinery for family modules: the spellings and block layouts several families share.

Not a family itself (its name starts with an underscore, so `known()` skips it).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from ..components import Attention, Layer, Mlp, Value, vllm_attention
from ..components import vllm as on_vllm

#: The containers of every model on transformers' llama layout (``model.{embed_tokens, layers, norm}``).
LLAMA_RENAME = {"model.layers": "layers", "model.embed_tokens": "embed_tokens", "model.norm": "norm"}
#: The llama containers of a vLLM model that unembeds with its embedding (no head module): it answers to both names.
VLLM_TIED_RENAME = {**LLAMA_RENAME, "model.embed_tokens": ["embed_tokens", "lm_head"]}
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
    layer_names: dict[str, Any] | None = None,
    **attention_names: Any,
) -> tuple[type, ...]:
    """A family's own ``Layer``, ``Attention`` and ``Mlp``: subclasses of the given bases, owned by ``module``.

    ``attention_names`` set the Attention's operation and module names (``OUTPUT_PROJECTION="dense"``);
    ``mlp_names`` the Mlp's (``{"ROUTER": "gate"}`` on a mixture of experts); ``layer_names`` the Layer's
    attributes (values placed elsewhere).
    """
    made = []
    names = {"Layer": layer_names or {}, "Attention": attention_names, "Mlp": mlp_names or {}}
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


#: `vllm_classes` keywords for a block that norms each sublayer's output before adding it (Gemma-2/3, EXAONE 4).
VLLM_POST_NORMS = {
    "attention_output": "post_attention_layernorm.output",
    "mlp_output": "post_feedforward_layernorm.output",
}


def vllm_classes(
    module: str,
    layer: type = on_vllm.DualStreamLayer,
    attention: type = vllm_attention.Attention,
    mlp: type = on_vllm.Mlp,
    *,
    attention_output: str | None = None,
    mlp_output: str | None = None,
    scale: str | None = None,
    mlp_names: dict[str, Any] | None = None,
    **attention_names: Any,
) -> tuple:
    """A vLLM family's own ``Layer``, ``Attention`` and ``Mlp`` (llama-like dense blocks unless told otherwise).

    ``attention_output`` / ``mlp_output`` place what the block adds elsewhere than its sublayers' outputs (a
    post-norm's output, ``"post_attention_layernorm.output"``); ``scale`` names the block attribute the block
    multiplies both by before adding them (``"residual_multiplier"``).
    """
    layer_names = {}
    for name, key, sublayer in (("attention_output", attention_output, "self_attn"), ("mlp_output", mlp_output, "mlp")):
        description = Layer.values()[name].description
        if scale is not None:
            layer_names[name] = on_vllm.FlatScaled(key or f"{sublayer}.output", scale=scale, description=description)
        elif key is not None:
            layer_names[name] = on_vllm.Flat(key, description=description)
    return classes(
        module,
        layer=layer,
        attention=attention,
        mlp=mlp,
        mlp_names=mlp_names,
        layer_names=layer_names,
        **attention_names,
    )


def softcap(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """``post_head`` for a model that soft-caps its logits (``config.final_logit_softcapping``)."""
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


#: What a family module may declare besides its names and classes: carried over to the Transformers backend.
FAMILY_HOOKS = (
    "post_head",
    "final_norm",
    "UNAVAILABLE",
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "num_experts",
    "num_experts_per_token",
)


def _backend_class(cls: type, module: str) -> type:
    """A transformers family's envoy class as served on the Transformers backend (see `transformers_backend`)."""
    if issubclass(cls, Attention):
        # The interior is vLLM's kernel's; what the family says is missing (a reason given as text) stays missing.
        gaps = {name: value for name, value in cls.values().items() if isinstance(value.unavailable, str)}
        base, namespace = vllm_attention.TransformersAttention, {"OUTPUT_PROJECTION": cls.OUTPUT_PROJECTION, **gaps}
    else:
        values = {}
        for klass in reversed(cls.__mro__):
            values.update({name: attr for name, attr in vars(klass).items() if isinstance(attr, Value)})
        base, namespace = cls, {name: on_vllm.copied(value) for name, value in values.items()}
    return type(cls.__qualname__, (base,), {**namespace, "__module__": module, "__qualname__": cls.__qualname__})


def transformers_backend(family: ModuleType, namespace: dict[str, Any]) -> None:
    """Fill a vLLM family module's ``namespace`` to serve ``family`` (a transformers family) on vLLM's
    Transformers backend, which runs transformers' own modules for an architecture vLLM has no code of its own for.

    The backend keeps the base model at ``model`` (whatever transformers calls it) and the head at ``lm_head``;
    each of the family's envoy classes becomes one whose values are read as copies at the same locations, its
    attention's interior read around vLLM's kernel; its size functions and head steps carry over.
    """
    from transformers import PreTrainedModel

    hf = importlib.import_module(next(key for key in family.ENVOYS if isinstance(key, type)).__module__)
    prefix = next(
        cls.base_model_prefix
        for cls in vars(hf).values()
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel) and cls.base_model_prefix
    )
    namespace["RENAME"] = {
        "model." + path.split(".", 1)[1] if path.split(".", 1)[0] == prefix and "." in path else path: name
        for path, name in family.RENAME.items()
    }
    served = {}
    for cls in dict.fromkeys(family.ENVOYS.values()):
        served[cls] = namespace[cls.__qualname__] = _backend_class(cls, namespace["__name__"])
    namespace["ENVOYS"] = {key: served[cls] for key, cls in family.ENVOYS.items()}
    namespace.update({name: getattr(family, name) for name in FAMILY_HOOKS if hasattr(family, name)})
