"""Mellum (``MellumForCausalLM``): the llama layout with a sparse ``mlp``.

``mlp`` is a dense MLP or a sparse block, as ``mlp_layer_types`` says per block.
"""

from transformers.models.mellum import modeling_mellum as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.MellumDecoderLayer: Layer,
    hf.MellumAttention: Attention,
    hf.MellumSparseMoeBlock: Mlp,
    hf.MellumMLP: Mlp,
}
