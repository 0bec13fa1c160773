"""BLOOM on vLLM: one-tensor blocks, a fused ``query_key_value``, ALiBi inside the kernel."""

from vllm.model_executor.models import bloom as vllm_bloom

from ...components import vllm as on_vllm
from .._layouts import vllm_classes
from ..bloom import RENAME, intermediate_size

Layer, Attention, Mlp = vllm_classes(__name__, layer=on_vllm.Layer, OUTPUT_PROJECTION="dense")
ENVOYS = {vllm_bloom.BloomBlock: Layer, vllm_bloom.BloomAttention: Attention, vllm_bloom.BloomMLP: Mlp}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "intermediate_size"]
