"""AFMoE (``AfmoeForCausalLM``): norms around each sublayer, a gated attention output, a sparse ``mlp``.

Each sublayer's output is normed before it is added (``post_attention_layernorm``,
``post_mlp_layernorm``): those norms' outputs are the contributions. The attention multiplies its
per-head mix by a sigmoid gate before the output projection, so ``attention_premix`` is the gated
mix, read at the projection's input (what the heads' outputs are made of). ``mlp`` is a dense
MLP on the first ``num_dense_layers`` blocks, then a sparse block with shared experts.
"""

from transformers.models.afmoe import modeling_afmoe as hf

from ..components import GatedAttention, Value
from ..components import Layer as BaseLayer
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME


class AfmoeLayer(BaseLayer):
    attention_output = Value("post_attention_layernorm.output", description=BaseLayer.attention_output.description)
    mlp_output = Value("post_mlp_layernorm.output", description=BaseLayer.mlp_output.description)


Layer, Attention, Mlp = classes(__name__, layer=AfmoeLayer, attention=GatedAttention, mlp_names={"ROUTER": "router"})
ENVOYS = {
    hf.AfmoeDecoderLayer: Layer,
    hf.AfmoeAttention: Attention,
    hf.AfmoeSparseMoeBlock: Mlp,
    hf.AfmoeMLP: Mlp,
}
