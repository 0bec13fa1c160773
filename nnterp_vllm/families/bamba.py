"""Bamba (``BambaForCausalLM``): Jamba's containers; each block is an attention or a mamba-2 block, then an MLP.

The mamba-2 scan is served as ``mixer``, the MLP (``feed_forward``) as ``mlp``.
"""

from transformers.models.bamba import modeling_bamba as hf

from ..components import Mixer
from ._layouts import classes
from .jamba import HYBRID_RENAME

RENAME = HYBRID_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.BambaDecoderLayer: Layer, hf.BambaAttention: Attention, hf.BambaMixer: Mixer, hf.BambaMLP: Mlp}
