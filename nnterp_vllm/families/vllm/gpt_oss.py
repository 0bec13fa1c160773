"""gpt-oss on vLLM: llama-like blocks passing ``(hidden, residual)``; attention ``attn`` with sinks; ``mlp`` routed
by ``router``. The queries, keys and values are served with the scores or not at all (see the transformers family).
"""

from vllm.model_executor.models import gpt_oss as vllm_gpt_oss

from ...components import vllm as on_vllm
from ...components import vllm_attention
from .._layouts import LLAMA_RENAME, vllm_classes
from ..gpt_oss import SinkAttention


class SinkKernelAttention(vllm_attention.Attention):
    attention_scores = SinkAttention.attention_scores
    attention_probabilities = SinkAttention.attention_probabilities
    attention_queries = SinkAttention.attention_queries
    attention_keys = SinkAttention.attention_keys
    attention_values = SinkAttention.attention_values


RENAME = {**LLAMA_RENAME, "model.embedding": "embed_tokens", "attn": "self_attn"}
Layer, Attention, Mlp = vllm_classes(
    __name__, attention=SinkKernelAttention, mlp=on_vllm.SparseMlp, mlp_names={"ROUTER": "router"}
)
ENVOYS = {vllm_gpt_oss.TransformerBlock: Layer, vllm_gpt_oss.OAIAttention: Attention, vllm_gpt_oss.MLPBlock: Mlp}
