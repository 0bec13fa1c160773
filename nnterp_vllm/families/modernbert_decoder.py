"""ModernBERT decoder (``ModernBertDecoderForCausalLM``): ``model.{embeddings, layers, final_norm}``; ``decoder`` head.

The head is a prediction transform (``lm_head``: dense, activation, norm) followed by the projection onto
the vocabulary (``decoder``), so the unembedding is ``decoder`` and `final_norm` applies the final norm
and the transform. The embeddings module norms the token embeddings (``tok_embeddings``, served as
``token_embeddings``) before the first block. The first block's ``attn_norm`` is an identity.
"""

from typing import Any

import torch
from transformers.models.modernbert_decoder import modeling_modernbert_decoder as hf

from ._layouts import classes

RENAME = {
    "model.embeddings.tok_embeddings": "embed_tokens",
    "model.layers": "layers",
    "model.final_norm": "norm",
    "attn": "self_attn",
}
UNEMBEDDING = "decoder"

Layer, Attention, Mlp = classes(__name__, OUTPUT_PROJECTION="Wo")
ENVOYS = {hf.ModernBertDecoderLayer: Layer, hf.ModernBertDecoderAttention: Attention, hf.ModernBertDecoderMLP: Mlp}


def final_norm(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The final norm, then the prediction transform (``lm_head``) the model runs before ``decoder``."""
    return model.lm_head(model.norm(hidden))
