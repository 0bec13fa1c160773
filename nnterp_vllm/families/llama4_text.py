"""Llama 4 text (``Llama4ForCausalLM``): the llama layout with its MLP as ``feed_forward``, dense or sparse.

Rotary blocks (``no_rope_layers`` entries 1) attend within chunks of ``attention_chunk_size``; the
others have no rotary and scale their queries by position before the attention call.
``mlp`` is a dense MLP off ``moe_layers``, else a sparse block with a shared expert, returning
``(output, router_logits)``. Its router ``router`` returns ``(scores, logits)``: ``scores`` holds
the sigmoid of the top-k logits and zeros elsewhere, and every expert is run on every token
pre-scaled by its score, so the experts module takes no indices or weights.
"""

from transformers.models.llama4 import modeling_llama4 as hf

from ..components import Mlp as BaseMlp
from ..components import unavailable
from ._layouts import LLAMA_RENAME, classes

RENAME = {**LLAMA_RENAME, "feed_forward": "mlp"}

DENSE_ROUTING = (
    "every expert runs on every token, its input scaled by the router's dense score matrix "
    "(router output 0: the sigmoid of the top-k logits, zero elsewhere); read router_logits and "
    "take its top num_experts_per_tok for the choice"
)


class RoutedMlp(BaseMlp):
    """A feed-forward sublayer whose experts take pre-scaled inputs instead of indices and weights."""

    expert_indices = unavailable(DENSE_ROUTING)
    expert_weights = unavailable(DENSE_ROUTING)


Layer, Attention, Mlp = classes(__name__, mlp=RoutedMlp, mlp_names={"ROUTER": "router", "ROUTER_LOGITS": 1})
ENVOYS = {
    hf.Llama4TextDecoderLayer: Layer,
    hf.Llama4TextAttention: Attention,
    hf.Llama4TextMoe: Mlp,
    hf.Llama4TextMLP: Mlp,
}
