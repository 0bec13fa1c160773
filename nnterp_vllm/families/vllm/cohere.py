"""Command-R on vLLM: a parallel block whose output's first element is the stream (beside the unread residual)."""

from vllm.model_executor.models import commandr as vllm_commandr

from ...components import vllm as on_vllm
from .._layouts import VLLM_TIED_RENAME, vllm_classes
from ..cohere import post_head

RENAME = VLLM_TIED_RENAME
Layer, Attention, Mlp = vllm_classes(__name__, layer=on_vllm.Layer)
ENVOYS = {
    vllm_commandr.CohereDecoderLayer: Layer,
    vllm_commandr.CohereAttention: Attention,
    vllm_commandr.CohereMLP: Mlp,
}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "post_head"]
