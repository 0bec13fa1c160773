"""Mixtral (``MixtralForCausalLM``): the llama layout with a sparse mixture-of-experts block as ``mlp``."""

from transformers.models.mixtral import modeling_mixtral as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {hf.MixtralDecoderLayer: Layer, hf.MixtralAttention: Attention, hf.MixtralSparseMoeBlock: Mlp}
