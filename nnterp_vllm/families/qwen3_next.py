"""Qwen3-Next (``Qwen3NextForCausalLM``): the llama layout; each block's token mixer is gated attention or a delta net.

A block holds ``self_attn`` (``full_attention`` in ``layer_types``) or a gated delta net ``linear_attn``,
served as ``mixer``. The attention multiplies its per-head mix by a sigmoid gate before the output
projection, so ``attention_premix`` is the gated mix, read at the projection's input (what the heads'
outputs are made of). ``mlp`` is a sparse block with a gated shared expert, or a dense MLP on
``mlp_only_layers``.
"""

from transformers.models.qwen3_next import modeling_qwen3_next as hf

from ..components import GatedAttention, Mixer
from ._layouts import LLAMA_RENAME, classes

RENAME = {**LLAMA_RENAME, "linear_attn": "mixer"}

Layer, Attention, Mlp = classes(__name__, attention=GatedAttention, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.Qwen3NextDecoderLayer: Layer,
    hf.Qwen3NextAttention: Attention,
    hf.Qwen3NextGatedDeltaNet: Mixer,
    hf.Qwen3NextSparseMoeBlock: Mlp,
    hf.Qwen3NextMLP: Mlp,
}
