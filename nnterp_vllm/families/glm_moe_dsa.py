"""GLM-MoE-DSA (``GlmMoeDsaForCausalLM``): the llama layout with sparse latent attention and a sparse ``mlp``.

The latent keys and values are expanded to every head before the attention call, so the interior has
the standard shapes. Each query attends to ``index_topk`` keys, chosen from the block's input by the
attention's ``indexer`` (``full`` entries of ``indexer_types``) or taken over from the previous block
(``shared`` entries), and folded into the mask before the call: the pattern is zero off the chosen
keys, and writing the keys does not change which keys are chosen. The blocks return the choice
after their output (the attention, after its pattern). ``mlp`` is a dense MLP on the ``dense``
entries of ``mlp_layer_types``, else a sparse block with shared experts whose router ``gate`` returns
``(logits, weights, indices)``.
"""

from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.GlmMoeDsaDecoderLayer: Layer,
    hf.GlmMoeDsaAttention: Attention,
    hf.GlmMoeDsaMoE: Mlp,
    hf.GlmMoeDsaMLP: Mlp,
}
