"""Gemma-2 (``Gemma2ForCausalLM``): the llama layout with post-sublayer norms and soft-capped logits."""

from transformers.models.gemma2 import modeling_gemma2 as hf

from ._layouts import LLAMA_RENAME, PostNormLayer, classes, softcap

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, layer=PostNormLayer)
ENVOYS = {hf.Gemma2DecoderLayer: Layer, hf.Gemma2Attention: Attention, hf.Gemma2MLP: Mlp}
post_head = softcap
