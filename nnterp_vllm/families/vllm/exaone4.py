"""EXAONE 4 on vLLM: one-tensor stream (output's first element), each sublayer's output normed before it is added."""

from vllm.model_executor.models import exaone4 as vllm_exaone4

from ...components import vllm as on_vllm
from .._layouts import LLAMA_RENAME, VLLM_POST_NORMS, vllm_classes

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__, layer=on_vllm.Layer, **VLLM_POST_NORMS)
ENVOYS = {
    vllm_exaone4.Exaone4DecoderLayer: Layer,
    vllm_exaone4.Exaone4Attention: Attention,
    vllm_exaone4.Exaone4GatedMLP: Mlp,
}
