"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): the llama layout with sparse latent attention and a sparse ``mlp``.

The latent keys and values are expanded to every head before the attention call, so the interior has
the standard shapes. The attention's ``indexer`` picks ``index_topk`` keys per query from the block's
input and folds that choice into the mask before the call: the pattern is zero off the chosen keys,
and writing the keys does not change which keys are chosen. ``mlp`` is a dense MLP on the ``dense``
entries of ``mlp_layer_types``, else a sparse block with shared experts whose router ``gate`` returns
``(logits, weights, indices)``.
"""

from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.DeepseekV32DecoderLayer: Layer,
    hf.DeepseekV32Attention: Attention,
    hf.DeepseekV32MoE: Mlp,
    hf.DeepseekV32MLP: Mlp,
}
