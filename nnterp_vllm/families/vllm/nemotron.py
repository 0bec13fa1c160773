"""Nemotron on vLLM: llama-like blocks passing ``(hidden, residual)`` (LayerNorm1P norms, a two-linear MLP)."""

from vllm.model_executor.models import nemotron as vllm_nemotron

from .._layouts import LLAMA_RENAME, vllm_classes

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__)
ENVOYS = {
    vllm_nemotron.NemotronDecoderLayer: Layer,
    vllm_nemotron.NemotronAttention: Attention,
    vllm_nemotron.NemotronMLP: Mlp,
}
