"""Mixtral on vLLM: llama-like blocks passing ``(hidden, residual)``; the sparse block ``block_sparse_moe``."""

from vllm.model_executor.models import mixtral as vllm_mixtral

from ...components import vllm as on_vllm
from .._layouts import LLAMA_RENAME, vllm_classes

RENAME = {**LLAMA_RENAME, "block_sparse_moe": "mlp"}
Layer, Attention, Mlp = vllm_classes(__name__, mlp=on_vllm.SparseMlp)
ENVOYS = {
    vllm_mixtral.MixtralDecoderLayer: Layer,
    vllm_mixtral.MixtralAttention: Attention,
    vllm_mixtral.MixtralMoE: Mlp,
}
