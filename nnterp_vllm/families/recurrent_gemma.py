"""RecurrentGemma (``RecurrentGemmaForCausalLM``): Griffin blocks mixing tokens by an RG-LRU recurrence or attention.

Each block's ``temporal_block`` is local attention (served as ``self_attn``) or a recurrent block (a
convolution and an RG-LRU scan, served as ``mixer``), as ``block_types`` says; ``mlp_block`` is served as
``mlp`` and ``final_norm`` as ``norm``. The embeddings are multiplied by ``sqrt(hidden_size)`` before the
first block: ``token_embeddings`` is the table's output, ``layers[0].layer_input`` the scaled stream. The
logits are soft-capped at ``config.logits_soft_cap``.
"""

from typing import Any

import torch
from transformers.models.recurrent_gemma import modeling_recurrent_gemma as hf

from ..components import Mixer
from ._layouts import classes

RENAME = {
    "model.layers": "layers",
    "model.embed_tokens": "embed_tokens",
    "model.final_norm": "norm",
    hf.RecurrentGemmaAttention: "self_attn",
    hf.RecurrentGemmaRecurrentBlock: "mixer",
    "mlp_block": "mlp",
}

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {
    hf.RecurrentGemmaDecoderLayer: Layer,
    hf.RecurrentGemmaAttention: Attention,
    hf.RecurrentGemmaRecurrentBlock: Mixer,
    hf.RecurrentGemmaMlp: Mlp,
}


def post_head(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """The head's output soft-capped at ``config.logits_soft_cap``, as the model's forward does."""
    cap = model.config.get_text_config().logits_soft_cap
    return torch.tanh(logits / cap) * cap


def intermediate_size(model: Any) -> int:
    """The MLP width is half ``config.intermediate_size`` (its gate and up projections share the budget)."""
    return model.config.get_text_config().intermediate_size // 2
