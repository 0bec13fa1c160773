"""GPT-2 on vLLM: one-tensor blocks, a fused ``c_attn``."""

from vllm.model_executor.models import gpt2 as vllm_gpt2

from ...components import vllm as on_vllm
from ...components import vllm_attention
from .._layouts import GPT2_RENAME, vllm_classes
from ..gpt2 import intermediate_size


class GPT2Attention(vllm_attention.Attention):
    OUTPUT_PROJECTION = "c_proj"


RENAME = GPT2_RENAME
Layer, Attention, Mlp = vllm_classes(__name__, layer=on_vllm.Layer, attention=GPT2Attention)
ENVOYS = {vllm_gpt2.GPT2Block: Layer, vllm_gpt2.GPT2Attention: Attention, vllm_gpt2.GPT2MLP: Mlp}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "intermediate_size"]
