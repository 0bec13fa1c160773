"""Qwen3-Next (``Qwen3NextForCausalLM``): the llama layout; each block's token mixer is gated attention or a delta net.

A block holds ``self_attn`` (``full_attention`` in ``layer_types``) or a gated delta net ``linear_attn``,
served as ``mixer``. The attention multiplies its per-head mix by a sigmoid gate before the output
projection, so ``attention_premix`` is the gated mix, read at the projection's input (what the heads'
outputs are made of). ``mlp`` is a sparse block with a gated shared expert, or a dense MLP on
``mlp_only_layers``.
"""

from typing import Any

from transformers.models.qwen3_next import modeling_qwen3_next as hf

from ..components import Attention as BaseAttention
from ..components import Mixer, Value
from ._layouts import LLAMA_RENAME, classes


class GatedAttention(BaseAttention):
    """Attention that gates each head's mix by a sigmoid of a query-side projection before ``o_proj``."""

    @Value(
        "{self.OUTPUT_PROJECTION}.input",
        description="Per-head gated mix of the values entering the output projection [batch, seq, heads, head_dim]",
        unavailable=lambda attention: attention.interior_reason(),
    )
    def attention_premix(self, value: Any) -> Any:
        """Each head's gated mix of the values, before the heads are projected."""
        return value.unflatten(-1, (-1, self._module.head_dim))

    @attention_premix.postprocess
    def attention_premix(self, value: Any) -> Any:
        return value.flatten(-2)


RENAME = {**LLAMA_RENAME, "linear_attn": "mixer"}

Layer, Attention, Mlp = classes(__name__, attention=GatedAttention, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.Qwen3NextDecoderLayer: Layer,
    hf.Qwen3NextAttention: Attention,
    hf.Qwen3NextGatedDeltaNet: Mixer,
    hf.Qwen3NextSparseMoeBlock: Mlp,
    hf.Qwen3NextMLP: Mlp,
}
