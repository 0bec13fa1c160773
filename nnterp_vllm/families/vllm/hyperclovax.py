"""HyperCLOVA X on vLLM: one-tensor stream; each sublayer's post-norm output times ``residual_multiplier``."""

from vllm.model_executor.models import hyperclovax as vllm_hyperclovax

from ...components import vllm as on_vllm
from .._layouts import LLAMA_RENAME, vllm_classes
from ..hyperclovax import post_head

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(
    __name__,
    layer=on_vllm.Layer,
    attention_output="post_norm1.output",
    mlp_output="post_norm2.output",
    scale="residual_multiplier",
)
ENVOYS = {
    vllm_hyperclovax.HyperCLOVAXDecoderLayer: Layer,
    vllm_hyperclovax.HyperCLOVAXAttention: Attention,
    vllm_hyperclovax.HyperCLOVAXMLP: Mlp,
}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "post_head"]
