"""Nemotron-H (``NemotronHForCausalLM``): ``model.{embeddings, layers, norm_f}``; a block is a norm and one ``mixer``.

A block's ``mixer`` is a mamba-2 scan, an attention, a dense MLP or a sparse block, by ``layers_block_type``: it
keeps its name on scan blocks and is served as ``self_attn`` or ``mlp`` on the others (keyed by class, as one
name holds all four). A block adds its one sublayer's output, so an attention block has no ``mlp_output`` and
an MLP block no ``mixer_output``. The sparse block's router (``gate``) returns the logits first; its weights
include ``routed_scaling_factor``.
"""

from transformers.models.nemotron_h import modeling_nemotron_h as hf

from ..components import Mixer
from ._layouts import classes

RENAME = {
    "model.layers": "layers",
    "model.embeddings": "embed_tokens",
    "model.norm_f": "norm",
    hf.NemotronHAttention: "self_attn",
    hf.NemotronHMoE: "mlp",
    hf.NemotronHMLP: "mlp",
}

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.NemotronHBlock: Layer,
    hf.NemotronHAttention: Attention,
    hf.NemotronHMamba2Mixer: Mixer,
    hf.NemotronHMoE: Mlp,
    hf.NemotronHMLP: Mlp,
}
