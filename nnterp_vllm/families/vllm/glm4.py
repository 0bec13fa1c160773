"""GLM-4 on vLLM: llama-like blocks passing ``(hidden, residual)``, a norm after each sublayer besides before it."""

from vllm.model_executor.models import glm4 as vllm_glm4
from vllm.model_executor.models import llama as vllm_llama

from .._layouts import LLAMA_RENAME, vllm_classes

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(
    __name__, attention_output="post_self_attn_layernorm.output", mlp_output="post_mlp_layernorm.output"
)
ENVOYS = {vllm_glm4.Glm4DecoderLayer: Layer, vllm_glm4.Glm4Attention: Attention, vllm_llama.LlamaMLP: Mlp}
