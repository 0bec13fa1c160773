"""Nemotron (``NemotronForCausalLM``): the llama layout (LayerNorm1P norms, a two-linear MLP)."""

from transformers.models.nemotron import modeling_nemotron as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.NemotronDecoderLayer: Layer, hf.NemotronAttention: Attention, hf.NemotronMLP: Mlp}
