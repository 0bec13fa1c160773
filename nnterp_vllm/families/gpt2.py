"""GPT-2 (``GPT2LMHeadModel``): ``transformer.{wte, h, ln_f}``, a fused ``c_attn`` and ``Conv1D`` projections."""

from typing import Any

from transformers.models.gpt2 import modeling_gpt2 as hf

from ..components import Attention
from ._layouts import GPT2_RENAME, classes

RENAME = GPT2_RENAME


class GPT2Attention(Attention):
    OUTPUT_PROJECTION = "c_proj"

    def interior_reason(self) -> str | None:
        if self._module.config.reorder_and_upcast_attn:
            return "this checkpoint sets reorder_and_upcast_attn, which takes GPT-2's own upcast attention path"
        return super().interior_reason()


Layer, Attention, Mlp = classes(__name__, attention=GPT2Attention)
ENVOYS = {hf.GPT2Block: Layer, hf.GPT2Attention: Attention, hf.GPT2MLP: Mlp}


def intermediate_size(model: Any) -> int:
    """The MLP width is ``n_inner``; unset means four times the hidden size."""
    return model.config.n_inner or 4 * model.hidden_size
