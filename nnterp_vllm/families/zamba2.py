"""Zamba-2 (``Zamba2ForCausalLM``): Zamba's layout with mamba-2 scans and the shared block named ``shared_transformer``.

As in `zamba`, a hybrid block's attention (served as ``self_attn``) feeds its mamba block's input through
``linear``, and only the mamba block's scan (served as ``mixer``) adds to the residual stream. Hybrid blocks cycle
through ``num_mem_blocks`` shared attention blocks, each with per-block adapters where the config enables them.
"""

from transformers.models.zamba2 import modeling_zamba2 as hf

from ..components import Layer, Mixer
from ._layouts import classes
from .jamba import HYBRID_RENAME
from .zamba import HybridLayer

RENAME = {**HYBRID_RENAME, "shared_transformer.self_attn": "self_attn", "mamba_decoder.mamba": "mixer"}

_, Attention, _ = classes(__name__)
# Keyed by path, so the mamba block inside a hybrid block stays a plain module.
ENVOYS = {
    "layers.*": Layer,
    hf.Zamba2HybridLayer: HybridLayer,
    hf.Zamba2Attention: Attention,
    hf.Zamba2MambaMixer: Mixer,
}
