"""EXAONE MoE on vLLM: llama-like blocks passing ``(hidden, residual)``; ``mlp`` dense or sparse (``gate``)."""

from vllm.model_executor.models import exaone4 as vllm_exaone4
from vllm.model_executor.models import exaone_moe as vllm_exaone_moe

from ...components import vllm as on_vllm
from .._layouts import LLAMA_RENAME, vllm_classes

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__, mlp=on_vllm.SparseMlp)
ENVOYS = {
    vllm_exaone_moe.ExaoneMoeDecoderLayer: Layer,
    vllm_exaone_moe.ExaoneMoeAttention: Attention,
    vllm_exaone_moe.ExaoneMoe: Mlp,
    vllm_exaone4.Exaone4GatedMLP: Mlp,
}
