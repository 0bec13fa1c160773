"""Qwen3-MoE on vLLM: llama-like blocks passing ``(hidden, residual)``; a sparse or dense ``mlp``."""

from vllm.model_executor.models import qwen3_moe as vllm_qwen3_moe

from ...components import vllm as on_vllm
from .._layouts import LLAMA_RENAME, vllm_classes

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__, mlp=on_vllm.SparseMlp)
ENVOYS = {
    vllm_qwen3_moe.Qwen3MoeDecoderLayer: Layer,
    vllm_qwen3_moe.Qwen3MoeAttention: Attention,
    vllm_qwen3_moe.Qwen3MoeSparseMoeBlock: Mlp,
    vllm_qwen3_moe.Qwen3MoeMLP: Mlp,
}
