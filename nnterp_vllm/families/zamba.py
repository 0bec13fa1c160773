"""Zamba (``ZambaForCausalLM``): Jamba's containers; mamba blocks, and hybrid blocks that feed a shared attention block.

A hybrid block (``shared_transf``, ``linear``, ``mamba_decoder``) runs an attention-and-MLP block, whose weights
all hybrid blocks share, on its input concatenated with the embeddings, projects that through ``linear`` and adds
it to the input of its mamba block (``mamba_decoder``), which alone adds to the residual stream. So the block's
``mixer`` is that mamba block's scan, its attention is served as ``self_attn`` (it reaches the stream only
through the scan's input) and it has no ``attention_output``/``mlp_output`` of its own.
"""

from transformers.models.zamba import modeling_zamba as hf

from ..components import Layer, Mixer, unavailable
from ._layouts import classes
from .jamba import HYBRID_RENAME

RENAME = {**HYBRID_RENAME, "shared_transf.self_attn": "self_attn", "mamba_decoder.mamba": "mixer"}


class HybridLayer(Layer):
    """A hybrid block: its mamba block's scan is what it adds; the shared attention feeds that scan's input."""

    attention_output = unavailable(
        "the shared attention block's output goes through `linear` into the mamba block's input, not onto the "
        "residual stream; read mixer_output for what the block adds, self_attn.attention_output for the attention's"
    )


_, Attention, _ = classes(__name__)
# Keyed by path, so the mamba block inside a hybrid block stays a plain module.
ENVOYS = {
    "layers.*": Layer,
    hf.ZambaHybridLayer: HybridLayer,
    hf.ZambaAttention: Attention,
    hf.ZambaMambaMixer: Mixer,
}
