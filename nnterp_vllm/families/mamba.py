"""Mamba (``MambaForCausalLM``): ``backbone.{embeddings, layers, norm_f}``; each block is a norm and a ``mixer`` scan.

The block adds the selective-scan mixer's output to the stream; it has no attention and no MLP.
"""

from transformers.models.mamba import modeling_mamba as hf

from ..components import Layer, Mixer

#: The containers of every pure state-space model on transformers' mamba layout.
BACKBONE_RENAME = {"backbone.layers": "layers", "backbone.embeddings": "embed_tokens", "backbone.norm_f": "norm"}

RENAME = BACKBONE_RENAME
ENVOYS = {hf.MambaBlock: Layer, hf.MambaMixer: Mixer}
