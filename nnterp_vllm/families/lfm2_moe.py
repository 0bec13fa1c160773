"""LFM2-MoE (``Lfm2MoeForCausalLM``): LFM2's convolution / attention blocks with a sparse ``mlp``.

The layout of `lfm2`; ``feed_forward`` is a dense MLP on the first ``num_dense_layers`` blocks, then a
mixture of experts whose router is ``gate``.
"""

from transformers.models.lfm2_moe import modeling_lfm2_moe as hf

from ..components import Mixer
from ._layouts import classes

RENAME = {
    "model.layers": "layers",
    "model.embed_tokens": "embed_tokens",
    "model.embedding_norm": "norm",
    hf.Lfm2MoeShortConv: "mixer",
    "feed_forward": "mlp",
}

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"}, OUTPUT_PROJECTION="out_proj")
ENVOYS = {
    hf.Lfm2MoeDecoderLayer: Layer,
    hf.Lfm2MoeAttention: Attention,
    hf.Lfm2MoeShortConv: Mixer,
    hf.Lfm2MoeMLP: Mlp,
    hf.Lfm2MoeSparseMoeBlock: Mlp,
}
