"""Granite MoE SWA (``GraniteMoeSWAForCausalLM``): `granitemoeshared`'s blocks with sliding windows and sinks.

Blocks attend fully or over a sliding window, with rotary positions or none (``layer_rope_theta``).
Each head has a learned sink, applied after the softmax: the per-head mix of the values is scaled
by ``sigmoid(logsumexp(scores) - sink)``, the share the keys keep beside the sink. The pattern is
the softmax over the keys (rows sum to 1), and ``attention_premix`` the scaled mix. The sparse
block's router returns the logits first; the rest as in `granitemoeshared`.
"""

from transformers.models.granitemoe_swa import modeling_granitemoe_swa as hf

from ._layouts import LLAMA_RENAME, classes
from .granite import post_head
from .granitemoeshared import SharedLayer, SparseMlp

RENAME = {**LLAMA_RENAME, "block_sparse_moe": "mlp"}

Layer, Attention, Mlp = classes(
    __name__,
    layer=SharedLayer,
    mlp=SparseMlp,
    mlp_names={"ROUTER": "router"},
    SCORES="F_softmax_0.input",
    PROBABILITIES="F_dropout_0.output",
)
ENVOYS = {hf.GraniteMoeSWADecoderLayer: Layer, hf.GraniteMoeSWAAttention: Attention, hf.GraniteMoeSWAMoE: Mlp}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "post_head"]
