"""GLM (``GlmForCausalLM``): the llama layout (a fused ``gate_up_proj`` MLP, partial rotary)."""

from transformers.models.glm import modeling_glm as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.GlmDecoderLayer: Layer, hf.GlmAttention: Attention, hf.GlmMLP: Mlp}
