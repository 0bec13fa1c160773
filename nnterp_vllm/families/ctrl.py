"""CTRL (``CTRLLMHeadModel``): ``transformer.{w, h, layernorm}``; shared-interface attention; ``ffn`` MLP.

The model scales the token embeddings in place after the embedding module returns them, so ``token_embeddings``
reads them already multiplied by ``sqrt(hidden_size)``.
"""

from typing import Any

from transformers.models.ctrl import modeling_ctrl as hf

from ._layouts import classes

RENAME = {
    "transformer.w": "embed_tokens",
    "transformer.h": "layers",
    "transformer.layernorm": "norm",
    "multi_head_attention": "self_attn",
    "ffn": "mlp",
}


Layer, Attention, Mlp = classes(__name__, OUTPUT_PROJECTION="dense")
ENVOYS = {hf.EncoderLayer: Layer, hf.MultiHeadAttention: Attention, "layers.*.mlp": Mlp}


def intermediate_size(model: Any) -> int:
    """The MLP width is ``dff``."""
    return model.config.dff
