"""DeepSeek-V4 (``DeepseekV4ForCausalLM``): hyper-connected residual streams, sink attention, a sparse ``mlp``.

The residual stream is ``hc_mult`` streams, ``[batch, seq, hc_mult, hidden]``, so ``layer_input`` and
``layer_output`` have that shape; ``attn_hc`` and ``ffn_hc`` collapse the streams into each sublayer's
input, spread its output over them and mix them, and ``hc_head`` collapses them before the final norm.
The attention shares one key-value head, runs its softmax over the keys (plus compressed entries on
compressed layers) and a per-head sink logit, un-rotates its mix and projects it in two grouped stages
(``o_a_proj``, ``o_b_proj``). ``mlp``'s router ``gate`` returns ``(logits, weights, indices)``; on
``hash_moe`` blocks the indices come from a token-id table (``gate.tid2eid``), the logits only weighting
the chosen experts.
"""

from typing import Any

import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from ..components import Attention as BaseAttention
from ..components import Layer as BaseLayer
from ..components import unavailable
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

STREAMS = (
    "the block adds each sublayer's output to hc_mult residual streams with per-token weights and mixes "
    "the streams (attn_hc, ffn_hc), so layer_output != layer_input + sublayer outputs; read "
    "self_attn.attention_output and mlp.mlp_output for the sublayers' outputs"
)
SINKS = (
    "the softmax runs over the keys, the compressed entries of compressed layers and a per-head sink "
    "logit whose share is dropped, and the mix is un-rotated and projected in two grouped stages "
    "(o_a_proj, o_b_proj): no [batch, heads, seq, seq] pattern nor single output projection; read "
    "attention_output"
)


class StreamsLayer(BaseLayer):
    """A block over hyper-connected streams: no sublayer contribution adds up to its output."""

    attention_output = unavailable(STREAMS)
    mlp_output = unavailable(STREAMS)


class SinkAttention(BaseAttention):
    """Sink attention whose only standard value is its output."""

    def interior_reason(self) -> str | None:
        """No interior value fits the standard shapes."""
        return SINKS


Layer, Attention, Mlp = classes(__name__, layer=StreamsLayer, attention=SinkAttention, mlp_names={"ROUTER": "gate"})
ENVOYS = {hf.DeepseekV4DecoderLayer: Layer, hf.DeepseekV4Attention: Attention, hf.DeepseekV4SparseMoeBlock: Mlp}


def final_norm(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The streams collapsed by ``hc_head``, then the final norm."""
    return model.norm(model.model.hc_head(hidden))
