"""Gemma-3 text (``Gemma3ForCausalLM``): the llama layout with post-sublayer norms.

Logits are soft-capped where the config says so.
"""

from transformers.models.gemma3 import modeling_gemma3 as hf

from ._layouts import LLAMA_RENAME, PostNormLayer, classes, softcap

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, layer=PostNormLayer)
ENVOYS = {hf.Gemma3DecoderLayer: Layer, hf.Gemma3Attention: Attention, hf.Gemma3MLP: Mlp}
post_head = softcap
