"""StableLM on vLLM: one-tensor stream (the output's first element), sequential blocks.

vLLM's StableLM runs the sequential block only and has no per-head query/key norms, whatever the config says.
"""

from vllm.model_executor.models import stablelm as vllm_stablelm

from ...components import vllm as on_vllm
from .._layouts import LLAMA_RENAME, vllm_classes

RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__, layer=on_vllm.Layer)
ENVOYS = {
    vllm_stablelm.StablelmDecoderLayer: Layer,
    vllm_stablelm.StablelmAttention: Attention,
    vllm_stablelm.StablelmMLP: Mlp,
}
