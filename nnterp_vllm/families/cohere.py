"""Command-R (``CohereForCausalLM``): the llama layout with a parallel block (attention and MLP read one norm).

The head's logits are multiplied by ``config.logit_scale``.
"""

from typing import Any

import torch
from transformers.models.cohere import modeling_cohere as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.CohereDecoderLayer: Layer, hf.CohereAttention: Attention, hf.CohereMLP: Mlp}


def post_head(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """The head's output times ``config.logit_scale``, as the model's forward does."""
    return logits * model.config.get_text_config().logit_scale
