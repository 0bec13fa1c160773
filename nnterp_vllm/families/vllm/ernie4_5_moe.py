"""ERNIE 4.5 MoE on vLLM: llama-like blocks passing ``(hidden, residual)``; ``mlp`` dense or sparse (``gate``)."""

from vllm.model_executor.models import ernie45_moe as vllm_ernie45_moe

from ...components import vllm as on_vllm
from .._layouts import LLAMA_RENAME, vllm_classes

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__, mlp=on_vllm.SparseMlp)
ENVOYS = {
    vllm_ernie45_moe.Ernie4_5_MoeDecoderLayer: Layer,
    vllm_ernie45_moe.Ernie4_5_MoeAttention: Attention,
    vllm_ernie45_moe.Ernie4_5_MoeMoE: Mlp,
    vllm_ernie45_moe.Ernie4_5_MoeMLP: Mlp,
}
