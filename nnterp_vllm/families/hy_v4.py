"""Hunyuan V4 (``HYV4ForCausalLM``): hyper-connected residual streams, gated sink attention, a sparse ``mlp``.

The residual stream is ``hc_mult`` streams, ``[batch, seq, hc_mult, hidden]``, so ``layer_input`` and
``layer_output`` have that shape; ``attn_hc`` and ``ffn_hc`` collapse the streams into each sublayer's
input and spread its output over them with per-token weights, and ``hc_head`` collapses them before the
final norm. The latent attention lets each query attend to the keys an indexer selects (its own or an
earlier block's), runs its softmax over them and a per-head sink logit whose share is dropped, and
multiplies each head's mix by a sigmoid gate before the output projection (``attention_premix`` is the
gated mix, see `axk2`). ``mlp`` is a dense MLP or a sparse block with shared experts, as
``mlp_layer_types`` says per block.
"""

from transformers.models.hy_v4 import modeling_hy_v4 as hf

from ..components import Layer as BaseLayer
from ..components import unavailable
from ._layouts import LLAMA_RENAME, classes
from .axk2 import GatedAttention
from .deepseek_v4 import final_norm

RENAME = LLAMA_RENAME

STREAMS = (
    "the block adds each sublayer's output to hc_mult residual streams with per-token weights (attn_hc, "
    "ffn_hc), so layer_output != layer_input + sublayer outputs; read self_attn.attention_output and "
    "mlp.mlp_output for the sublayers' outputs"
)
SINKS = (
    "the softmax runs over the keys and a per-head sink logit whose share is dropped, so the scores have "
    "seq + 1 columns and the pattern's rows do not sum to 1; queries, keys and values are served with them "
    "or not at all; read attention_premix or attention_head_outputs"
)


class StreamsLayer(BaseLayer):
    attention_output = unavailable(STREAMS)
    mlp_output = unavailable(STREAMS)


class SinkAttention(GatedAttention):
    attention_queries = unavailable(SINKS)
    attention_keys = unavailable(SINKS)
    attention_values = unavailable(SINKS)
    attention_scores = unavailable(SINKS)
    attention_probabilities = unavailable(SINKS)


Layer, Attention, Mlp = classes(__name__, layer=StreamsLayer, attention=SinkAttention, mlp_names={"ROUTER": "gate"})
ENVOYS = {hf.HYV4DecoderLayer: Layer, hf.HYV4Attention: Attention, hf.HYV4MoE: Mlp, hf.HYV4MLP: Mlp}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "final_norm"]
