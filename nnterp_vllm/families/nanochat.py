"""nanochat (``NanoChatForCausalLM``): the llama layout with weightless norms, q/k norms and soft-capped logits.

The model calls its one ``norm`` module twice: on the embeddings before the first block, and on the
last block's output. ``norm.output`` reads the first call, so ``final_norm_output`` is not served;
``layers[0].layer_input`` is the normed embeddings.
"""

from typing import Any

import torch
from transformers.models.nanochat import modeling_nanochat as hf

from ._layouts import LLAMA_RENAME, classes, softcap

RENAME = LLAMA_RENAME
UNAVAILABLE = {
    "final_norm_output": (
        "nanochat calls its one norm module twice (on the embeddings before the first block, then on the last "
        "block's output), and norm.output reads the first call; apply model.norm to layers[-1].layer_output"
    )
}

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.NanoChatDecoderLayer: Layer, hf.NanoChatAttention: Attention, hf.NanoChatMLP: Mlp}
post_head = softcap


def final_norm(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The model's second call of its ``norm`` (the same weightless RMS norm it applies to the embeddings)."""
    return model.norm(hidden)
