"""GPT-J (``GPTJForCausalLM``): GPT-2 containers, a parallel block, and attention arithmetic of its own (``_attn``)."""

from transformers.models.gptj import modeling_gptj as hf

from ..components import Attention
from ._layouts import GPT2_RENAME, classes

RENAME = GPT2_RENAME


class GPTJAttention(Attention):
    INTERFACE = "self__attn_0"
    QKV_ARGS = (0, 1, 2)
    PROBABILITIES = "self_attn_dropout_0.output"
    PREMIX_HEADS_FIRST = True
    OUTPUT_PROJECTION = "out_proj"


Layer, Attention, Mlp = classes(__name__, attention=GPTJAttention)
ENVOYS = {hf.GPTJBlock: Layer, hf.GPTJAttention: Attention, hf.GPTJMLP: Mlp}
