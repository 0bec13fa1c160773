"""gpt-oss (``GptOssForCausalLM``): the llama layout with attention sinks and a sparse ``mlp``.

Each head's softmax runs over the keys and one learned sink logit, and the sink's share is
dropped before the values are mixed: the pattern's rows over the keys do not sum to 1 and the
scores entering the softmax have one column more than there are keys. Neither fits the standard
``[batch, heads, seq, seq]`` scores / probabilities, and the queries, keys and values are served
with them or not at all; the per-head mix and the heads' outputs are served.
"""

from transformers.models.gpt_oss import modeling_gpt_oss as hf

from ..components import Attention as BaseAttention
from ..components import unavailable
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

SINKS = "gpt-oss's softmax runs over the keys and a per-head sink logit whose share is dropped, so the " + (
    "scores have seq + 1 columns and the pattern's rows do not sum to 1"
)


class SinkAttention(BaseAttention):
    attention_scores = unavailable(SINKS)
    attention_probabilities = unavailable(SINKS)
    attention_queries = unavailable(SINKS + "; queries, keys and values are served with the scores")
    attention_keys = unavailable(SINKS + "; queries, keys and values are served with the scores")
    attention_values = unavailable(SINKS + "; queries, keys and values are served with the scores")


Layer, Attention, Mlp = classes(__name__, attention=SinkAttention, mlp_names={"ROUTER": "router"})
ENVOYS = {hf.GptOssDecoderLayer: Layer, hf.GptOssAttention: Attention, hf.GptOssMLP: Mlp}
