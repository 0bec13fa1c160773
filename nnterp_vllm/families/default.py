"""The family for a model_type with no module: common spellings, and only what a name can show.

Its RENAME is the union of the spellings the shipped families use for the containers,
the embedding, the final norm, the head and a block's attention. It serves the residual
stream, the root values, the sizes and the attention interior wherever the attention
calls transformers' shared attention interface. What a sublayer adds depends on the
block's code, so those values are unavailable here.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..components import INTERFACE, Attention, Layer, Mlp, needs_eager, unavailable
from ..errors import UnavailableValue, UnsupportedFamily

RENAME = {
    "model.layers": "layers",
    "model.decoder.layers": "layers",
    "transformer.h": "layers",
    "transformer.layers": "layers",
    "transformer.blocks": "layers",
    "gpt_neox.layers": "layers",
    "model.embed_tokens": "embed_tokens",
    "model.decoder.embed_tokens": "embed_tokens",
    "transformer.wte": "embed_tokens",
    "transformer.word_embeddings": "embed_tokens",
    "transformer.embed_tokens": "embed_tokens",
    "gpt_neox.embed_in": "embed_tokens",
    "model.norm": "norm",
    "model.decoder.final_layer_norm": "norm",
    "model.final_layernorm": "norm",
    "transformer.ln_f": "norm",
    "transformer.norm_f": "norm",
    "transformer.norm": "norm",
    "gpt_neox.final_layer_norm": "norm",
    "embed_out": "lm_head",
    "attn": "self_attn",
    "self_attention": "self_attn",
    "attention": "self_attn",
}

SUBLAYER = (
    "what a sublayer adds to the residual stream depends on the block's code, which the default "
    "family does not read; add a family module for this model_type"
)
PROJECTIONS = ("o_proj", "out_proj", "c_proj", "dense", "wo")


class Layer(Layer):
    attention_output = unavailable(SUBLAYER)
    mlp_output = unavailable(SUBLAYER)


class Attention(Attention):
    attention_output = unavailable(SUBLAYER)

    @property
    def OUTPUT_PROJECTION(self) -> str:  # noqa: N802 - the attribute the component reads
        return next((name for name in PROJECTIONS if hasattr(self._module, name)), PROJECTIONS[0])

    def interior_reason(self) -> str | None:
        source = inspect.getsource(type(self._module).forward)
        if f"{INTERFACE.rsplit('_', 1)[0]}(" not in source:
            return "this attention does not call transformers' shared attention interface"
        return needs_eager(self)


class Mlp(Mlp):
    mlp_output = unavailable(SUBLAYER)


ENVOYS = {"layers.*": Layer, "layers.*.self_attn": Attention, "layers.*.mlp": Mlp}


def check(model: Any) -> None:
    """Raise `UnsupportedFamily` naming what is missing when the default family cannot serve ``model``."""
    missing = [name for name in ("layers", "embed_tokens", "norm", "lm_head") if not hasattr(model, name)]
    if missing:
        raise UnsupportedFamily(
            f"the default family cannot serve model_type {model.config.model_type!r}: no module answers to "
            f"{missing} under the spellings it knows ({sorted(set(RENAME))}). "
            "Pass rename={native_path: standard_name} or add a family module."
        )
    if not any(isinstance(block, Layer) for block in model.layers):
        raise UnsupportedFamily(
            f"the default family cannot serve model_type {model.config.model_type!r}: "
            f"no block under {model.layers.path} is recognised as a decoder block"
        )


def post_head(model: Any, logits: Any) -> Any:
    """Refused: what follows the head (a soft cap, a scale) depends on code a name does not show."""
    raise UnavailableValue(
        f"project_on_vocab is not available on model_type {model.config.model_type!r} with the default family: "
        "what the model does after its head depends on code the default family does not read; "
        "add a family module for this model_type"
    )
