"""Qwen2-MoE (``Qwen2MoeForCausalLM``): the llama layout with a sparse ``mlp``.

``mlp`` is a sparse block with a gated shared expert, or a dense MLP on ``mlp_only_layers``.
"""

from transformers.models.qwen2_moe import modeling_qwen2_moe as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.Qwen2MoeDecoderLayer: Layer,
    hf.Qwen2MoeAttention: Attention,
    hf.Qwen2MoeSparseMoeBlock: Mlp,
    hf.Qwen2MoeMLP: Mlp,
}
