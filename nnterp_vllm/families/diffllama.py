"""DiffLlama (``DiffLlamaForCausalLM``): the llama layout with differential attention.

The attention calls transformers' shared attention function twice, with the same queries, keys
and mask and the two halves of the values, then combines heads ``h`` and ``h + heads/2`` as a
group-normed difference before ``o_proj``. So queries and keys are read where rotary returns
them and values where they are split in two (both calls see an edit; in cached generation the
keys are the new positions' only, the values include the cached ones); the pattern is the first
call's (the second's is the same) and is read-only, since a write would reach one call only; and
there is no per-head mix: ``o_proj`` reads ``heads/2`` differential heads of twice the width.
"""

from transformers.models.diffllama import modeling_diffllama as hf

from ..components import WHOLE, Attention, Value, unavailable
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME
ROTARY = "source.apply_rotary_pos_emb_0.output"
READ_ONLY = "; read-only here: both attention calls use it, write the queries or keys instead"
NO_HEADS = (
    "differential attention: o_proj reads num_heads/2 differential heads of width 2*head_dim, each a "
    "group-normed difference of two heads' mixes, so no per-head mix or per-head output exists"
)


def _interior(attention: Attention) -> str | None:
    return attention.interior_reason()


class DiffLlamaAttention(Attention):
    attention_queries = Value(ROTARY, select=0, description=Attention.attention_queries.description)
    attention_keys = Value(ROTARY, select=1, description=Attention.attention_keys.description)
    attention_values = Value("source.torch_chunk_0.input", description=Attention.attention_values.description)
    attention_scores = Value(
        "source.{self.INTERFACE}.source.{self.SCORES}",
        description=Attention.attention_scores.description + READ_ONLY,
        unavailable=_interior,
        writable=False,
    )
    attention_probabilities = Value(
        "source.{self.INTERFACE}.source.{self.PROBABILITIES}",
        select=WHOLE,
        description=Attention.attention_probabilities.description + READ_ONLY,
        unavailable=_interior,
        writable=False,
    )
    attention_premix = unavailable(NO_HEADS)
    attention_head_outputs = unavailable(NO_HEADS)


Layer, Attention, Mlp = classes(__name__, attention=DiffLlamaAttention)
ENVOYS = {hf.DiffLlamaDecoderLayer: Layer, hf.DiffLlamaAttention: Attention, hf.DiffLlamaMLP: Mlp}
