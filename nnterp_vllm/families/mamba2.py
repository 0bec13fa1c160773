"""Mamba-2 (``Mamba2ForCausalLM``): Mamba's ``backbone`` layout; each block is a norm and a ``mixer`` (a mamba-2 scan).

The block adds the mixer's output to the stream; it has no attention and no MLP.
"""

from transformers.models.mamba2 import modeling_mamba2 as hf

from ..components import Layer, Mixer
from .mamba import BACKBONE_RENAME

RENAME = BACKBONE_RENAME
ENVOYS = {hf.Mamba2Block: Layer, hf.Mamba2Mixer: Mixer}
