"""StableLM (``StableLmForCausalLM``): the llama layout, parallel or sequential as ``use_parallel_residual`` says.

Either way the block adds the attention module's and the MLP module's outputs.
"""

from transformers.models.stablelm import modeling_stablelm as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.StableLmDecoderLayer: Layer, hf.StableLmAttention: Attention, hf.StableLmMLP: Mlp}
