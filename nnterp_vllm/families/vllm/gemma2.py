"""Gemma-2 on vLLM: post-sublayer norms, soft-capped logits, embeddings scaled outside the embedding module."""

from vllm.model_executor.models import gemma2 as vllm_gemma2

from .._layouts import LLAMA_RENAME, PostNormVLLMLayer, softcap, vllm_classes
from .gemma import UNAVAILABLE

#: vLLM's Gemma-2 has no head module: it unembeds with the embedding, which answers to both names.
RENAME = {**LLAMA_RENAME, "model.embed_tokens": ["embed_tokens", "lm_head"]}
Layer, Attention, Mlp = vllm_classes(__name__, layer=PostNormVLLMLayer)
ENVOYS = {vllm_gemma2.Gemma2DecoderLayer: Layer, vllm_gemma2.Gemma2Attention: Attention, vllm_gemma2.Gemma2MLP: Mlp}
post_head = softcap
__all__ = ["ENVOYS", "RENAME", "UNAVAILABLE", "Attention", "Layer", "Mlp", "post_head"]
