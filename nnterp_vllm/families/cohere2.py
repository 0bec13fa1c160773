"""Command-R7B (``Cohere2ForCausalLM``): Command-R's layout (a parallel block) and its logit scale."""

from transformers.models.cohere2 import modeling_cohere2 as hf

from ._layouts import LLAMA_RENAME, classes
from .cohere import post_head

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.Cohere2DecoderLayer: Layer, hf.Cohere2Attention: Attention, hf.Cohere2MLP: Mlp}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "post_head"]
