"""A.X K2 (``AXK2ForCausalLM``): latent attention with a sparse-token indexer and an output gate; a sparse ``mlp``.

The latent keys and values are expanded to every head before the attention call. An indexer picks
the ``index_topk`` keys each query may attend to and folds that choice into the attention mask, so
the scores and pattern are those of the selected keys (the others masked). Each head's mix is
multiplied by a sigmoid gate before the output projection: ``attention_premix`` is the gated mix,
read at the projection's input. ``mlp`` is a dense MLP or a sparse block with shared experts, as
``mlp_layer_types`` says per block.
"""

from transformers.models.axk2 import modeling_axk2 as hf

from ..components import GatedAttention as BaseGatedAttention
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME


class GatedAttention(BaseGatedAttention):
    HEAD_WIDTH = "v_head_dim"


Layer, Attention, Mlp = classes(__name__, attention=GatedAttention, mlp_names={"ROUTER": "gate"})
ENVOYS = {hf.AXK2DecoderLayer: Layer, hf.AXK2Attention: Attention, hf.AXK2MoE: Mlp, hf.AXK2MLP: Mlp}
