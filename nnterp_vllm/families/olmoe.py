"""OLMoE (``OlmoeForCausalLM``): the llama layout with a sparse mixture-of-experts block as ``mlp``."""

from transformers.models.olmoe import modeling_olmoe as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {hf.OlmoeDecoderLayer: Layer, hf.OlmoeAttention: Attention, hf.OlmoeSparseMoeBlock: Mlp}
