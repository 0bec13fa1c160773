"""OLMoE on vLLM: llama-like blocks passing ``(hidden, residual)``; a sparse ``mlp`` routed by ``gate``."""

from vllm.model_executor.models import olmoe as vllm_olmoe

from ...components import vllm as on_vllm
from .._layouts import LLAMA_RENAME, vllm_classes

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__, mlp=on_vllm.SparseMlp)
ENVOYS = {vllm_olmoe.OlmoeDecoderLayer: Layer, vllm_olmoe.OlmoeAttention: Attention, vllm_olmoe.OlmoeMoE: Mlp}
