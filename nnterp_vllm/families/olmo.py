"""OLMo (``OlmoForCausalLM``): the llama layout (non-parametric LayerNorms, optional q/k/v clipping)."""

from transformers.models.olmo import modeling_olmo as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.OlmoDecoderLayer: Layer, hf.OlmoAttention: Attention, hf.OlmoMLP: Mlp}
