"""Granite MoE (``GraniteMoeForCausalLM``): Granite's multipliers, with a sparse block named ``block_sparse_moe``.

The block is served as ``mlp``; its output times ``residual_multiplier`` is what the block adds
(see `granite`), and the head's logits are divided by ``logits_scaling``.
"""

from transformers.models.granitemoe import modeling_granitemoe as hf

from ._layouts import LLAMA_RENAME, classes
from .granite import GraniteLayer, post_head

RENAME = {**LLAMA_RENAME, "block_sparse_moe": "mlp"}

Layer, Attention, Mlp = classes(__name__, layer=GraniteLayer, mlp_names={"ROUTER": "router", "ROUTER_LOGITS": 2})
ENVOYS = {hf.GraniteMoeDecoderLayer: Layer, hf.GraniteMoeAttention: Attention, hf.GraniteMoeMoE: Mlp}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "post_head"]
