"""Granite MoE on vLLM: Granite's multipliers; the sparse block ``block_sparse_moe`` (routed by ``gate``)."""

from vllm.model_executor.models import granitemoe as vllm_granitemoe

from ...components import vllm as on_vllm
from .._layouts import LLAMA_RENAME, vllm_classes
from ..granite import post_head

RENAME = {**LLAMA_RENAME, "block_sparse_moe": "mlp"}
Layer, Attention, Mlp = vllm_classes(__name__, layer=on_vllm.Layer, mlp=on_vllm.SparseMlp, scale="residual_multiplier")
ENVOYS = {
    vllm_granitemoe.GraniteMoeDecoderLayer: Layer,
    vllm_granitemoe.GraniteMoeAttention: Attention,
    vllm_granitemoe.GraniteMoeMoE: Mlp,
}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "post_head"]
