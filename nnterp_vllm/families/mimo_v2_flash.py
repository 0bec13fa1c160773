"""MiMo-V2-Flash (``MiMoV2FlashForCausalLM``): the llama layout, attention sinks on sliding blocks, a sparse ``mlp``.

On sliding-window blocks each head's softmax runs over the keys and one learned sink logit whose
share is dropped before the values are mixed; full-attention blocks have no sink. The values are
scaled (``attention_value_scale``) before the attention call and may be narrower than the queries
and keys (``v_head_dim``). ``mlp`` is a dense MLP or a sparse block, as ``mlp_layer_types`` says.
"""

from nnsight.intervention.envoy import Envoy
from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash as hf

from ..components import Attention as BaseAttention
from ..components import Value
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

SINKS = "this sliding-window block's softmax runs over the keys and a per-head sink logit whose share is dropped, " + (
    "so the scores have seq + 1 columns and the pattern's rows do not sum to 1; queries, keys and values are "
    "served with them, on the full-attention blocks; read attention_premix or attention_head_outputs here"
)


def _sink_reason(attention: Envoy) -> str | None:
    return SINKS if attention._module.sinks is not None else attention.interior_reason()


def _unless_sinks(name: str) -> Value:
    base = vars(BaseAttention)[name]
    return Value(base.key, select=base.select, description=base.description, unavailable=_sink_reason)


class SinkAttention(BaseAttention):
    #: The scaled, masked scores, before the sink column is added and the row maximum taken away.
    SCORES = "attn_weights_1.output"

    attention_queries = _unless_sinks("attention_queries")
    attention_keys = _unless_sinks("attention_keys")
    attention_values = _unless_sinks("attention_values")
    attention_scores = _unless_sinks("attention_scores")
    attention_probabilities = _unless_sinks("attention_probabilities")


Layer, Attention, Mlp = classes(__name__, attention=SinkAttention, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.MiMoV2FlashDecoderLayer: Layer,
    hf.MiMoV2FlashAttention: Attention,
    hf.MiMoV2FlashMoE: Mlp,
    hf.MiMoV2FlashMLP: Mlp,
}
