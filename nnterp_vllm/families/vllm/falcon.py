"""Falcon on vLLM: BLOOM's containers, one-tensor parallel or sequential blocks, a fused ``query_key_value``.

The parallel block adds the attention's output into the MLP's output tensor in place after the MLP returns it;
``mlp_output`` is the copy taken before that, as on every value here.
"""

from vllm.model_executor.models import falcon as vllm_falcon

from ...components import vllm as on_vllm
from .._layouts import vllm_classes
from ..falcon import RENAME, intermediate_size, num_kv_heads

Layer, Attention, Mlp = vllm_classes(__name__, layer=on_vllm.Layer, OUTPUT_PROJECTION="dense")
ENVOYS = {vllm_falcon.FalconDecoderLayer: Layer, vllm_falcon.FalconAttention: Attention, vllm_falcon.FalconMLP: Mlp}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "intermediate_size", "num_kv_heads"]
