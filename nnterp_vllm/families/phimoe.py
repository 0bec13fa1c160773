"""PhiMoE (``PhimoeForCausalLM``): the llama layout (LayerNorms) with a sparse mixture-of-experts block as ``mlp``."""

from transformers.models.phimoe import modeling_phimoe as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "router"})
ENVOYS = {hf.PhimoeDecoderLayer: Layer, hf.PhimoeAttention: Attention, hf.PhimoeSparseMoeBlock: Mlp}
