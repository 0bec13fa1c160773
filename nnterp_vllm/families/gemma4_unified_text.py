"""Gemma-4 unified text (``Gemma4UnifiedForCausalLM``): Gemma-4's dense blocks, each rescaling the whole stream.

The blocks are Gemma-4 text's without the per-layer-input and mixture-of-experts branches: post-sublayer
norms, then the stream, residual included, multiplied by the learned ``layer_scalar`` buffer, so no
sublayer output is what the block adds. Sliding and full layers differ in head width; layers past
``num_kv_shared_layers`` reuse an earlier layer's keys and values (a write to them reaches that layer
alone). Logits are soft-capped where the config says so.
"""

from transformers.models.gemma4_unified import modeling_gemma4_unified as hf

from ._layouts import LLAMA_RENAME, classes, softcap
from .gemma4_text import RescaledLayer

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, layer=RescaledLayer)
ENVOYS = {
    hf.Gemma4UnifiedTextDecoderLayer: Layer,
    hf.Gemma4UnifiedTextAttention: Attention,
    hf.Gemma4UnifiedTextMLP: Mlp,
}
post_head = softcap
