"""Gemma on vLLM: llama-like blocks passing ``(hidden, residual)``."""

from vllm.model_executor.models import gemma as vllm_gemma

from .._layouts import LLAMA_RENAME, vllm_classes

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__)
ENVOYS = {vllm_gemma.GemmaDecoderLayer: Layer, vllm_gemma.GemmaAttention: Attention, vllm_gemma.GemmaMLP: Mlp}
UNAVAILABLE = {
    "token_embeddings": (
        "vLLM multiplies Gemma's embeddings by sqrt(hidden_size) outside the embedding module, so the "
        "module's output is not the stream entering the first block; read layers[0].layer_input"
    )
}
