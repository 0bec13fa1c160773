"""HunYuan dense v1 (``HunYuanDenseV1ForCausalLM``): the llama layout with query/key norms after rotary."""

from transformers.models.hunyuan_v1_dense import modeling_hunyuan_v1_dense as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.HunYuanDenseV1DecoderLayer: Layer, hf.HunYuanDenseV1Attention: Attention, hf.HunYuanDenseV1MLP: Mlp}
