"""ERNIE 4.5 MoE (``Ernie4_5_MoeForCausalLM``): the llama layout with a sparse ``mlp``.

``mlp`` is a sparse block with shared experts on the MoE layers (``moe_layer_start_index`` on), else a dense MLP.
"""

from transformers.models.ernie4_5_moe import modeling_ernie4_5_moe as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.Ernie4_5_MoeDecoderLayer: Layer,
    hf.Ernie4_5_MoeAttention: Attention,
    hf.Ernie4_5_MoeSparseMoeBlock: Mlp,
    hf.Ernie4_5_MoeMLP: Mlp,
}
