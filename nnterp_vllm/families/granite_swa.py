"""Granite SWA (``GraniteSWAForCausalLM``): Granite's multipliers, sliding-window layers and attention sinks.

The blocks, embeddings and head scale as Granite's do (see `granite`). Each head's softmax runs over
the keys alone, so ``attention_scores``/``attention_probabilities`` are the standard ones (rows sum
to 1); the mix of values is then scaled per query by ``sigmoid(logsumexp(scores) - sink)``, the
keys' share against the head's learned sink, and ``attention_premix`` is read after that scaling.
Layers whose ``layer_rope_theta`` is 0 use no rotary embedding.
"""

from transformers.models.granite_swa import modeling_granite_swa as hf

from ._layouts import LLAMA_RENAME, classes
from .granite import GraniteLayer
from .granite import post_head as post_head

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(
    __name__, layer=GraniteLayer, SCORES="F_softmax_0.input", PROBABILITIES="F_dropout_0.output"
)
ENVOYS = {hf.GraniteSWADecoderLayer: Layer, hf.GraniteSWAAttention: Attention, hf.GraniteSWAMLP: Mlp}
