"""A.X K1 (``AXK1ForCausalLM``): DeepSeek-V3's layout (latent attention, a sparse ``mlp``).

The latent keys and values are expanded to every head before the attention call. ``mlp`` is a
dense MLP on the first ``first_k_dense_replace`` blocks, then a sparse block with shared experts
whose sum is normed (``post_mlp_layernorm``) before the block adds it.
"""

from transformers.models.axk1 import modeling_axk1 as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {hf.AXK1DecoderLayer: Layer, hf.AXK1Attention: Attention, hf.AXK1MoE: Mlp, hf.AXK1MLP: Mlp}
