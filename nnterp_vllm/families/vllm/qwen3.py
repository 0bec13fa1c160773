"""Qwen3 on vLLM: llama-like blocks passing ``(hidden, residual)``."""

from vllm.model_executor.models import qwen3 as vllm_qwen3

from .._layouts import LLAMA_RENAME, vllm_classes

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__)
ENVOYS = {vllm_qwen3.Qwen3DecoderLayer: Layer, vllm_qwen3.Qwen3Attention: Attention, vllm_qwen3.Qwen3MLP: Mlp}
