"""DeepSeek-V2 (``DeepseekV2ForCausalLM``): the llama layout with latent attention and a sparse ``mlp``.

The latent keys and values are expanded to every head before the attention call, so the interior has
the standard shapes (keys with as many heads as the queries). ``mlp`` is a dense MLP on the first
``first_k_dense_replace`` blocks, then a sparse block with shared experts.
"""

from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.DeepseekV2DecoderLayer: Layer,
    hf.DeepseekV2Attention: Attention,
    hf.DeepseekV2Moe: Mlp,
    hf.DeepseekV2MLP: Mlp,
}
