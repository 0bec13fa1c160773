"""EXAONE MoE (``ExaoneMoeForCausalLM``): the llama layout with a sparse ``mlp``.

``mlp`` is a dense MLP or a sparse block with shared experts, as ``mlp_layer_types`` says per
block; sliding-window blocks use rotary positions, full-attention blocks none.
"""

from transformers.models.exaone_moe import modeling_exaone_moe as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.ExaoneMoeDecoderLayer: Layer,
    hf.ExaoneMoeAttention: Attention,
    hf.ExaoneMoeSparseMoEBlock: Mlp,
    hf.ExaoneMoeMLP: Mlp,
}
