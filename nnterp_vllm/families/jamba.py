"""Jamba (``JambaForCausalLM``): llama-like containers; each block is attention or a mamba scan, then a feed-forward.

The mamba scan is served as ``mixer``; the feed-forward (``feed_forward``, served as ``mlp``) is a dense MLP or,
every ``expert_layer_period`` blocks, a sparse mixture of experts with its ``router``. The final norm is
``final_layernorm``.
"""

from transformers.models.jamba import modeling_jamba as hf

from ..components import Mixer
from ._layouts import classes

#: The llama containers with the final norm named ``final_layernorm``, shared by the mamba-hybrid families.
HYBRID_RENAME = {
    "model.layers": "layers",
    "model.embed_tokens": "embed_tokens",
    "model.final_layernorm": "norm",
    "mamba": "mixer",
    "feed_forward": "mlp",
}
RENAME = HYBRID_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "router"})
ENVOYS = {
    hf.JambaAttentionDecoderLayer: Layer,
    hf.JambaMambaDecoderLayer: Layer,
    hf.JambaAttention: Attention,
    hf.JambaMambaMixer: Mixer,
    hf.JambaMLP: Mlp,
    hf.JambaSparseMoeBlock: Mlp,
}
