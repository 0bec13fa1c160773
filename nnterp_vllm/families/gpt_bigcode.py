"""GPTBigCode / StarCoder (``GPTBigCodeForCausalLM``): GPT-2 containers; multi-query, shared-interface attention."""

from typing import Any

from transformers.models.gpt_bigcode import modeling_gpt_bigcode as hf

from ..components import Attention
from ._layouts import GPT2_RENAME, classes

RENAME = GPT2_RENAME


class GPTBigCodeAttention(Attention):
    OUTPUT_PROJECTION = "c_proj"


Layer, Attention, Mlp = classes(__name__, attention=GPTBigCodeAttention)
ENVOYS = {hf.GPTBigCodeBlock: Layer, hf.GPTBigCodeAttention: Attention, hf.GPTBigCodeMLP: Mlp}


def num_kv_heads(model: Any) -> int:
    """Multi-query checkpoints share one key/value head; the others have one per query head."""
    return 1 if model.config.multi_query else model.num_heads


def intermediate_size(model: Any) -> int:
    """The MLP width is ``n_inner``; unset means four times the hidden size."""
    return model.config.n_inner or 4 * model.hidden_size
