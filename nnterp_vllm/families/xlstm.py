"""xLSTM (``xLSTMForCausalLM``): ``backbone.{embeddings, blocks, out_norm}``; blocks of an mLSTM, then a feed-forward.

The mLSTM layer (``mlstm_layer``) is served as ``mixer`` and the feed-forward (``ffn``) as ``mlp``; the
mLSTM and the block return their output beside the recurrent state, whose first element is served.
The logits are soft-capped at ``config.output_logit_soft_cap``.
"""

from typing import Any

import torch
from transformers.models.xlstm import modeling_xlstm as hf

from ..components import Layer, Mixer, Mlp

RENAME = {
    "backbone.embeddings": "embed_tokens",
    "backbone.blocks": "layers",
    "backbone.out_norm": "norm",
    "mlstm_layer": "mixer",
    "ffn": "mlp",
}
ENVOYS = {hf.xLSTMBlock: Layer, hf.xLSTMLayer: Mixer, hf.xLSTMFeedForward: Mlp}


def post_head(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """The head's output soft-capped at ``config.output_logit_soft_cap``, as the model's forward does."""
    cap = model.config.get_text_config().output_logit_soft_cap
    return torch.tanh(logits / cap) * cap if cap else logits


def intermediate_size(model: Any) -> int:
    """The feed-forward width: ``ffn_proj_factor`` times the hidden size, rounded up as the module builds it."""
    return model.layers[0].mlp._module.up_proj_dim
