"""Gemma-3 text on vLLM: Gemma-2's post-sublayer norms, embeddings scaled outside the embedding module."""

from vllm.model_executor.models import gemma3 as vllm_gemma3

from .._layouts import LLAMA_RENAME, VLLM_POST_NORMS, softcap, vllm_classes
from .gemma import UNAVAILABLE

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__, **VLLM_POST_NORMS)
ENVOYS = {vllm_gemma3.Gemma3DecoderLayer: Layer, vllm_gemma3.Gemma3Attention: Attention, vllm_gemma3.Gemma3MLP: Mlp}
post_head = softcap
__all__ = ["ENVOYS", "RENAME", "UNAVAILABLE", "Attention", "Layer", "Mlp", "post_head"]
