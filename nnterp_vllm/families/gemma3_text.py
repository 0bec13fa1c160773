"""Gemma-3 text (``Gemma3ForCausalLM``): the llama layout with post-sublayer norms.

Logits are soft-capped where the config says so.
"""

from transformers.models.gemma3 import modeling_gemma3 as hf

from ._layouts import LLAMA_RENAME as RENAME
from ._layouts import PostNormLayer, classes
from ._layouts import softcapped as project_on_vocab

Layer, Attention, Mlp = classes(__name__, layer=PostNormLayer)
ENVOYS = {hf.Gemma3DecoderLayer: Layer, hf.Gemma3Attention: Attention, hf.Gemma3MLP: Mlp}
__all__ = ["RENAME", "ENVOYS", "Layer", "Attention", "Mlp", "project_on_vocab"]
