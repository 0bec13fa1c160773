"""Command-A MoE (``Cohere2MoeForCausalLM``): Command-R's parallel block and logit scale.

``mlp`` is a dense MLP or a sparse block (``config.mlp_layer_types``); both read the block's normed input.
"""

from transformers.models.cohere2_moe import modeling_cohere2_moe as hf

from ._layouts import LLAMA_RENAME, classes
from .cohere import post_head

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.Cohere2MoeDecoderLayer: Layer,
    hf.Cohere2MoeAttention: Attention,
    hf.Cohere2MoeSparseMoeBlock: Mlp,
    hf.Cohere2MoeMLP: Mlp,
}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "post_head"]
