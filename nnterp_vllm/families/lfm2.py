"""LFM2 (``Lfm2ForCausalLM``): pre-norm blocks whose token mixer is a gated short convolution or softmax attention.

Each block holds either ``self_attn`` (``full_attention`` in ``layer_types``) or a short convolution
``conv``, served as ``mixer``; ``feed_forward`` is served as ``mlp``. The final norm is the model's
``embedding_norm``, which runs after the last block.
"""

from typing import Any

from transformers.models.lfm2 import modeling_lfm2 as hf

from ..components import Mixer
from ._layouts import classes

RENAME = {
    "model.layers": "layers",
    "model.embed_tokens": "embed_tokens",
    "model.embedding_norm": "norm",
    hf.Lfm2ShortConv: "mixer",
    "feed_forward": "mlp",
}

Layer, Attention, Mlp = classes(__name__, OUTPUT_PROJECTION="out_proj")
ENVOYS = {hf.Lfm2DecoderLayer: Layer, hf.Lfm2Attention: Attention, hf.Lfm2ShortConv: Mixer, hf.Lfm2MLP: Mlp}


def intermediate_size(model: Any) -> int:
    """The MLP width as built: ``block_auto_adjust_ff_dim`` shrinks and rounds ``config.intermediate_size``."""
    return model.layers[0].mlp._module.w1.out_features
