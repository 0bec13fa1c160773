"""Qwen2-MoE on vLLM: llama-like blocks passing ``(hidden, residual)``; a sparse or dense ``mlp``."""

from vllm.model_executor.models import qwen2_moe as vllm_qwen2_moe

from ...components import vllm as on_vllm
from .._layouts import LLAMA_RENAME, vllm_classes

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__, mlp=on_vllm.SparseMlp)
ENVOYS = {
    vllm_qwen2_moe.Qwen2MoeDecoderLayer: Layer,
    vllm_qwen2_moe.Qwen2MoeAttention: Attention,
    vllm_qwen2_moe.Qwen2MoeSparseMoeBlock: Mlp,
    vllm_qwen2_moe.Qwen2MoeMLP: Mlp,
}
