"""DBRX (``DbrxForCausalLM``): ``transformer.{wte, blocks, norm_f}``; each block nests its attention and norms.

A block is ``norm_attn_norm`` (the attention ``attn`` between two layer norms, served as
``self_attn``) then the sparse block ``ffn`` (served as ``mlp``; its ``router`` returns the logits).
The fused ``Wqkv`` projection's output is clamped to ``clip_qkv`` before it is split.
"""

from typing import Any

from transformers.models.dbrx import modeling_dbrx as hf

from ._layouts import classes

RENAME = {
    "transformer.wte": "embed_tokens",
    "transformer.blocks": "layers",
    "transformer.norm_f": "norm",
    "norm_attn_norm.attn": "self_attn",
    "ffn": "mlp",
}

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "router"}, OUTPUT_PROJECTION="out_proj")
ENVOYS = {hf.DbrxBlock: Layer, hf.DbrxAttention: Attention, hf.DbrxFFN: Mlp}


def intermediate_size(model: Any) -> int:
    """Each expert's width, ``ffn_config.ffn_hidden_size``."""
    return model.config.ffn_config.ffn_hidden_size


def num_experts(model: Any) -> int:
    """``ffn_config.moe_num_experts``."""
    return model.config.ffn_config.moe_num_experts


def num_experts_per_token(model: Any) -> int:
    """``ffn_config.moe_top_k``."""
    return model.config.ffn_config.moe_top_k
