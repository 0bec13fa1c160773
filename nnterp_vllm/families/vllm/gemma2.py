"""Gemma-2 on vLLM: post-sublayer norms, soft-capped logits, embeddings scaled outside the embedding module."""

from vllm.model_executor.models import gemma2 as vllm_gemma2

from .._layouts import VLLM_POST_NORMS, VLLM_TIED_RENAME, softcap, vllm_classes
from .gemma import UNAVAILABLE

RENAME = VLLM_TIED_RENAME
Layer, Attention, Mlp = vllm_classes(__name__, **VLLM_POST_NORMS)
ENVOYS = {vllm_gemma2.Gemma2DecoderLayer: Layer, vllm_gemma2.Gemma2Attention: Attention, vllm_gemma2.Gemma2MLP: Mlp}
post_head = softcap
__all__ = ["ENVOYS", "RENAME", "UNAVAILABLE", "Attention", "Layer", "Mlp", "post_head"]
