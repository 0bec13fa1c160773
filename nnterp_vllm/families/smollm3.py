"""SmolLM3 (``SmolLM3ForCausalLM``): the llama layout; some layers skip rotary."""

from transformers.models.smollm3 import modeling_smollm3 as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.SmolLM3DecoderLayer: Layer, hf.SmolLM3Attention: Attention, hf.SmolLM3MLP: Mlp}
