"""Phi-3 on vLLM: served by vLLM's llama modules (fused ``qkv_proj`` and ``gate_up_proj``)."""

from vllm.model_executor.models import llama as vllm_llama

from .._layouts import LLAMA_RENAME, vllm_classes

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__)
ENVOYS = {vllm_llama.LlamaDecoderLayer: Layer, vllm_llama.LlamaAttention: Attention, vllm_llama.LlamaMLP: Mlp}
