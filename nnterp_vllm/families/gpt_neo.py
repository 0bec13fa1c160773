"""GPT-Neo (``GPTNeoForCausalLM``): GPT-2 containers; the block's ``attn`` wraps the module that does the attention.

``attn`` (``GPTNeoAttention``) only forwards to ``attn.attention`` (``GPTNeoSelfAttention``, global or local),
whose arithmetic is its own (``_attn``), like GPT-J's. The standard ``self_attn`` is the wrapper, so its interior
values are the base ones moved one module down.
"""

from typing import Any

from nnsight.intervention.envoy import Envoy
from transformers.models.gpt_neo import modeling_gpt_neo as hf

from ..components import Attention, Value
from ._layouts import GPT2_RENAME, classes

RENAME = GPT2_RENAME
INNER = "attention"


def _inner(name: str) -> Value:
    """The base Attention's value ``name``, read on the wrapped module."""
    base = vars(Attention)[name]
    moved = Value.__new__(type(base))
    property.__init__(moved)
    vars(moved).update(vars(base), key=f"{INNER}.{base.key}")
    return moved


class GPTNeoAttention(Attention):
    INTERFACE = "self__attn_0"
    QKV_ARGS = (0, 1, 2)
    PROBABILITIES = "self_attn_dropout_0.output"
    PREMIX_HEADS_FIRST = True
    OUTPUT_PROJECTION = f"{INNER}.out_proj"

    @property
    def output_projection(self) -> Envoy:
        return getattr(self, INNER).out_proj

    attention_queries = _inner("attention_queries")
    attention_keys = _inner("attention_keys")
    attention_values = _inner("attention_values")
    attention_scores = _inner("attention_scores")
    attention_probabilities = _inner("attention_probabilities")
    attention_premix = _inner("attention_premix")


Layer, Attention, Mlp = classes(__name__, attention=GPTNeoAttention)
ENVOYS = {hf.GPTNeoBlock: Layer, hf.GPTNeoAttention: Attention, hf.GPTNeoMLP: Mlp}


def intermediate_size(model: Any) -> int:
    """The MLP width is ``intermediate_size``; unset means four times the hidden size."""
    return model.config.intermediate_size or 4 * model.hidden_size
