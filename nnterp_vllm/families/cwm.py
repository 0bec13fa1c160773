"""CWM (``CwmForCausalLM``): the llama layout, with sliding-window layers."""

from transformers.models.cwm import modeling_cwm as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.CwmDecoderLayer: Layer, hf.CwmAttention: Attention, hf.CwmMLP: Mlp}
