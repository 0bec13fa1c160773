"""Kimi-Linear (``KimiLinearForCausalLM``): the llama layout; each block's token mixer is latent attention or KDA.

``self_attn`` is multi-head latent attention without rotary on ``full_attention`` blocks; on the others it
is a delta-attention module, served as ``mixer``. The latent keys and values are expanded to every head
before the attention call, so the interior has the standard shapes. ``mlp`` is a dense MLP or a sparse
block (router ``gate``) with shared experts, as ``mlp_layer_types`` says.
"""

from typing import Any

from transformers.models.kimi_linear import modeling_kimi_linear as hf

from ..components import Mixer
from ._layouts import LLAMA_RENAME, classes

RENAME = {**LLAMA_RENAME, hf.KimiLinearDeltaAttention: "mixer"}
Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.KimiLinearDecoderLayer: Layer,
    hf.KimiLinearAttention: Attention,
    hf.KimiLinearDeltaAttention: Mixer,
    hf.KimiLinearMoE: Mlp,
    hf.KimiLinearMLP: Mlp,
}


def head_dim(model: Any) -> int:
    """The query/key head width, ``qk_nope_head_dim + qk_rope_head_dim`` (values are ``v_head_dim`` wide)."""
    config = model.config.get_text_config()
    return config.qk_nope_head_dim + config.qk_rope_head_dim
