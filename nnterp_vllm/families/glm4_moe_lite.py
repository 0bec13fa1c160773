"""GLM-4 MoE Lite (``Glm4MoeLiteForCausalLM``): the llama layout with latent attention and a sparse ``mlp``.

The latent keys and values are expanded to every head before the attention call, so the interior has
the standard shapes. ``mlp`` is a dense MLP on the ``dense`` entries of ``mlp_layer_types``, else a
sparse block with shared experts whose router ``gate`` returns ``(logits, weights, indices)``.
"""

from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.Glm4MoeLiteDecoderLayer: Layer,
    hf.Glm4MoeLiteAttention: Attention,
    hf.Glm4MoeLiteMoE: Mlp,
    hf.Glm4MoeLiteMLP: Mlp,
}
