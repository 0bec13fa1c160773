"""Gemma-2 on vLLM: post-sublayer norms, soft-capped logits, embeddings scaled outside the embedding module."""

from vllm.model_executor.models import gemma2 as vllm_gemma2

from .._layouts import VLLM_TIED_RENAME, softcap, vllm_classes
from .gemma import UNAVAILABLE

RENAME = VLLM_TIED_RENAME
Layer, Attention, Mlp = vllm_classes(
    __name__, attention_output="post_attention_layernorm.output", mlp_output="post_feedforward_layernorm.output"
)
ENVOYS = {vllm_gemma2.Gemma2DecoderLayer: Layer, vllm_gemma2.Gemma2Attention: Attention, vllm_gemma2.Gemma2MLP: Mlp}
post_head = softcap
__all__ = ["ENVOYS", "RENAME", "UNAVAILABLE", "Attention", "Layer", "Mlp", "post_head"]
