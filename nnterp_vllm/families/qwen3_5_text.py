"""Qwen3.5 (``Qwen3_5ForCausalLM``): Qwen3-Next's gated-attention / delta-net blocks with a dense ``mlp``.

The layout of `qwen3_next`: ``linear_attn`` is served as ``mixer`` and ``attention_premix`` is the
gated mix entering ``o_proj``.
"""

from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from ..components import GatedAttention, Mixer
from ._layouts import LLAMA_RENAME, classes

RENAME = {**LLAMA_RENAME, "linear_attn": "mixer"}

Layer, Attention, Mlp = classes(__name__, attention=GatedAttention)
ENVOYS = {
    hf.Qwen3_5DecoderLayer: Layer,
    hf.Qwen3_5Attention: Attention,
    hf.Qwen3_5GatedDeltaNet: Mixer,
    hf.Qwen3_5MLP: Mlp,
}
