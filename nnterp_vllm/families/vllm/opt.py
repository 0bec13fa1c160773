"""OPT on vLLM: ``model.decoder.*``, one-tensor blocks with the MLP as two bare linears (``fc1``, ``fc2``)."""

from vllm.model_executor.models import opt as vllm_opt

from ...components import vllm as on_vllm
from .._layouts import vllm_classes
from ..opt import RENAME, intermediate_size

Layer, Attention, Mlp = vllm_classes(
    __name__, layer=on_vllm.Layer, mlp_output="fc2.output", OUTPUT_PROJECTION="out_proj"
)
ENVOYS = {vllm_opt.OPTDecoderLayer: Layer, vllm_opt.OPTAttention: Attention}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "intermediate_size"]
