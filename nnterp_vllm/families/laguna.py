"""Laguna (``LagunaForCausalLM``): the llama layout with gated attention heads and a sparse ``mlp``.

The attention multiplies each head's mix by a softplus gate before the output projection, so
``attention_premix`` is the gated mix (see `afmoe`); blocks may differ in their number of query
heads. ``mlp`` is a dense MLP or a sparse block with shared experts whose routed part is scaled
(``moe_routed_scaling_factor``), as ``mlp_layer_types`` says per block.
"""

from transformers.models.laguna import modeling_laguna as hf

from ..components import GatedAttention
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, attention=GatedAttention, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.LagunaDecoderLayer: Layer,
    hf.LagunaAttention: Attention,
    hf.LagunaSparseMoeBlock: Mlp,
    hf.LagunaMLP: Mlp,
}
