"""Qwen2 on vLLM: llama-like blocks passing ``(hidden, residual)``."""

from vllm.model_executor.models import qwen2 as vllm_qwen2

from .._layouts import LLAMA_RENAME, vllm_classes

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__)
ENVOYS = {vllm_qwen2.Qwen2DecoderLayer: Layer, vllm_qwen2.Qwen2Attention: Attention, vllm_qwen2.Qwen2MLP: Mlp}
