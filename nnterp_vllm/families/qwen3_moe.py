"""Qwen3-MoE (``Qwen3MoeForCausalLM``): the llama layout with a sparse ``mlp``.

``mlp`` is a sparse block, or a dense MLP on ``mlp_only_layers``.
"""

from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.Qwen3MoeDecoderLayer: Layer,
    hf.Qwen3MoeAttention: Attention,
    hf.Qwen3MoeSparseMoeBlock: Mlp,
    hf.Qwen3MoeMLP: Mlp,
}
