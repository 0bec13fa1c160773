"""GLM-4 MoE (``Glm4MoeForCausalLM``): the llama layout with a sparse ``mlp``.

``mlp`` is a dense MLP on the first ``first_k_dense_replace`` blocks, then a sparse block with shared experts.
"""

from transformers.models.glm4_moe import modeling_glm4_moe as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {hf.Glm4MoeDecoderLayer: Layer, hf.Glm4MoeAttention: Attention, hf.Glm4MoeMoE: Mlp, hf.Glm4MoeMLP: Mlp}
