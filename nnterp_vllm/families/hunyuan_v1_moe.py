"""HunYuan MoE v1 (``HunYuanMoEV1ForCausalLM``): the llama layout; ``mlp`` is a sparse block with a shared MLP."""

from transformers.models.hunyuan_v1_moe import modeling_hunyuan_v1_moe as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {hf.HunYuanMoEV1DecoderLayer: Layer, hf.HunYuanMoEV1Attention: Attention, hf.HunYuanMoEV1Moe: Mlp}
