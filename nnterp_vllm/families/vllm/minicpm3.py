"""MiniCPM3 on vLLM: one-tensor stream; each sublayer's output times ``scale_depth / sqrt(num_layers)``."""

import math
from typing import Any

import torch
from vllm.model_executor.models import minicpm as vllm_minicpm
from vllm.model_executor.models import minicpm3 as vllm_minicpm3

from ...components import unavailable, vllm_attention
from ...components import vllm as on_vllm
from .._layouts import LLAMA_RENAME, vllm_classes


def residual_scale(layer: Any) -> float:
    """What the block multiplies each sublayer's output by before adding it."""
    config = layer._module.config
    return config.scale_depth / math.sqrt(config.num_hidden_layers)


PADDED = (
    "vLLM pads each head's values to the query/key head width (qk_nope_head_dim + qk_rope_head_dim) for its kernel "
    "and cuts the mix back before o_proj, so the kernel's values and mix are not the model's; read attention_output"
)


class LatentAttention(vllm_attention.Attention):
    attention_values = unavailable(PADDED)
    attention_premix = unavailable(PADDED)
    attention_head_outputs = unavailable(PADDED)


RENAME = LLAMA_RENAME
Layer, Attention, Mlp = vllm_classes(__name__, layer=on_vllm.Layer, attention=LatentAttention, scale=residual_scale)
ENVOYS = {
    vllm_minicpm3.MiniCPM3DecoderLayer: Layer,
    vllm_minicpm3.MiniCPM3Attention: Attention,
    vllm_minicpm.MiniCPMMLP: Mlp,
}
UNAVAILABLE = {
    "token_embeddings": (
        "vLLM multiplies MiniCPM3's embeddings by scale_emb outside the embedding module, so the module's output is "
        "not the stream entering the first block; read layers[0].layer_input"
    )
}


def post_head(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """The head's output divided by ``config.logits_scaling`` (the model divides the final norm's output, before its
    bias-free head: the same logits)."""
    return logits / model.config.get_text_config().logits_scaling
