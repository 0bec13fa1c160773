"""Granite on vLLM: one-tensor blocks adding each sublayer's output times ``residual_multiplier``."""

from vllm.model_executor.models import granite as vllm_granite

from ...components import vllm as on_vllm
from .._layouts import LLAMA_RENAME, vllm_classes
from ..granite import post_head

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__, layer=on_vllm.Layer, scale="residual_multiplier")
ENVOYS = {
    vllm_granite.GraniteDecoderLayer: Layer,
    vllm_granite.GraniteAttention: Attention,
    vllm_granite.GraniteMLP: Mlp,
}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "post_head"]
