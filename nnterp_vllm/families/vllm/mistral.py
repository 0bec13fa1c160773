"""Mistral on vLLM: llama-like blocks passing ``(hidden, residual)``; the block builds llama's MLP."""

from vllm.model_executor.models import llama as vllm_llama
from vllm.model_executor.models import mistral as vllm_mistral

from .._layouts import LLAMA_RENAME, vllm_classes

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__)
ENVOYS = {
    vllm_mistral.MistralDecoderLayer: Layer,
    vllm_mistral.MistralAttention: Attention,
    vllm_mistral.MistralMLP: Mlp,
    vllm_llama.LlamaMLP: Mlp,
}
