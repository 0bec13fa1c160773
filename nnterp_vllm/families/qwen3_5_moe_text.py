"""Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``): Qwen3-Next's gated-attention / delta-net blocks with a sparse ``mlp``.

The layout of `qwen3_next`: ``linear_attn`` is served as ``mixer``, ``attention_premix`` is the gated
mix entering ``o_proj``, and every block's ``mlp`` is a sparse block (router ``gate``) with a gated
shared expert.
"""

from typing import Any

from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

from ..components import GatedAttention, Mixer
from ._layouts import LLAMA_RENAME, classes

RENAME = {**LLAMA_RENAME, "linear_attn": "mixer"}

Layer, Attention, Mlp = classes(__name__, attention=GatedAttention, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.Qwen3_5MoeDecoderLayer: Layer,
    hf.Qwen3_5MoeAttention: Attention,
    hf.Qwen3_5MoeGatedDeltaNet: Mixer,
    hf.Qwen3_5MoeSparseMoeBlock: Mlp,
    hf.Qwen3_5MoeMLP: Mlp,
}


def intermediate_size(model: Any) -> int:
    """Every MLP is sparse: the width of one expert, ``moe_intermediate_size``."""
    return model.config.get_text_config().moe_intermediate_size
