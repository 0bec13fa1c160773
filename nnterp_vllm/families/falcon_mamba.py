"""Falcon-Mamba (``FalconMambaForCausalLM``): Mamba's ``backbone`` layout and blocks, with normed scan inputs.

The block adds the ``mixer``'s output to the stream; it has no attention and no MLP.
"""

from transformers.models.falcon_mamba import modeling_falcon_mamba as hf

from ..components import Layer, Mixer
from .mamba import BACKBONE_RENAME

RENAME = BACKBONE_RENAME
ENVOYS = {hf.FalconMambaBlock: Layer, hf.FalconMambaMixer: Mixer}
