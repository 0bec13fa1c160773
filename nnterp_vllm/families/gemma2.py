"""Gemma-2 (``Gemma2ForCausalLM``): the llama layout with post-sublayer norms and soft-capped logits."""

from transformers.models.gemma2 import modeling_gemma2 as hf

from ._layouts import LLAMA_RENAME as RENAME
from ._layouts import PostNormLayer, classes
from ._layouts import softcapped as project_on_vocab

Layer, Attention, Mlp = classes(__name__, layer=PostNormLayer)
ENVOYS = {hf.Gemma2DecoderLayer: Layer, hf.Gemma2Attention: Attention, hf.Gemma2MLP: Mlp}
__all__ = ["RENAME", "ENVOYS", "Layer", "Attention", "Mlp", "project_on_vocab"]
