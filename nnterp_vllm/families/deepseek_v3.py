"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): the llama layout with latent attention and a sparse ``mlp``.

The latent keys and values are expanded to every head before the attention call, so the interior has
the standard shapes (keys with as many heads as the queries). ``mlp`` is a dense MLP on the first
``first_k_dense_replace`` blocks, then a sparse block with shared experts.
"""

from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.DeepseekV3DecoderLayer: Layer,
    hf.DeepseekV3Attention: Attention,
    hf.DeepseekV3MoE: Mlp,
    hf.DeepseekV3MLP: Mlp,
}
