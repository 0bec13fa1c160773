"""LongCat-Flash (``LongcatFlashForCausalLM``): blocks of two attention-MLP pairs and a shortcut sparse ``mlp``.

Each block runs ``self_attn[0]``, ``mlps[0]``, ``self_attn[1]``, ``mlps[1]`` (latent attention and
dense MLPs, each added to the residual stream), and adds at the end the output of ``mlp``, a sparse
block fed the normed stream after ``self_attn[0]``. Each ``self_attn[j]`` is an `Attention`; the
pair itself serves no value. ``mlp``'s router is ``router``, returning ``(logits, weights, indices)``;
indices from ``n_routed_experts`` on pick identity experts. ``num_layers`` counts blocks (the config's
``num_hidden_layers`` counts attention sublayers).
"""

from typing import Any

from transformers.models.longcat_flash import modeling_longcat_flash as hf

from ..components import Layer as BaseLayer
from ..components import unavailable
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

TWO_SUBLAYERS = (
    "each block adds two attention sublayers (self_attn[0], self_attn[1]) and two dense MLPs "
    "(mlps[0], mlps[1]) besides the sparse mlp; read self_attn[0] or self_attn[1], or "
    "layer_output - layer_input - mlp_output for the four sublayers' sum"
)


class PairsLayer(BaseLayer):
    """A block whose non-sparse contribution is four sublayers' outputs."""

    attention_output = unavailable(TWO_SUBLAYERS)


Layer, Attention, Mlp = classes(__name__, layer=PairsLayer, mlp_names={"ROUTER": "router"})


class AttentionPair(Attention):
    """``self_attn``: the list of a block's two attention sublayers."""

    attention_output = unavailable(TWO_SUBLAYERS)

    def interior_reason(self) -> str | None:
        """The pair has no interior of its own."""
        return TWO_SUBLAYERS


ENVOYS = {
    hf.LongcatFlashDecoderLayer: Layer,
    hf.LongcatFlashMLA: Attention,
    hf.LongcatFlashMoE: Mlp,
    "self_attn": AttentionPair,
}


def num_layers(model: Any) -> int:
    """The number of blocks."""
    return model.config.num_layers


def num_experts(model: Any) -> int:
    """The router's choices: the routed experts and the identity experts."""
    config = model.config
    return config.n_routed_experts + (config.zero_expert_num or 0)
