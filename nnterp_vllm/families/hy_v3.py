"""Hunyuan V3 (``HYV3ForCausalLM``): the llama layout with a sparse ``mlp``.

``mlp`` is a dense MLP or a sparse block with shared experts, as ``mlp_layer_types`` says per block.
"""

from transformers.models.hy_v3 import modeling_hy_v3 as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {hf.HYV3DecoderLayer: Layer, hf.HYV3Attention: Attention, hf.HYV3MoE: Mlp, hf.HYV3MLP: Mlp}
