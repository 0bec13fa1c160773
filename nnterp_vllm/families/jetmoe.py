"""JetMoE (``JetMoeForCausalLM``): the llama layout with a mixture of attention heads and a sparse ``mlp``.

The attention (``self_attention``, served as ``self_attn``) routes each token to ``top_k``
query experts that share one set of key/value heads: the keys and values are repeated once per
expert slot before the attention call, so ``attention_keys`` / ``attention_values`` are read there,
with ``num_attention_heads`` heads (expert slot major). There is no single output projection: each
token's slots go through their own experts' projections and are summed (``experts.reduce``), so the
per-head outputs are unavailable; ``attention_premix`` is the mix per slot before that reduction. The sparse
block's router returns its logits last.
"""

from transformers.models.jetmoe import modeling_jetmoe as hf

from ..components import Attention as BaseAttention
from ..components import Mlp as BaseMlp
from ..components import unavailable
from ._layouts import LLAMA_RENAME, classes

RENAME = {**LLAMA_RENAME, "self_attention": "self_attn"}


class MixtureOfHeads(BaseAttention):
    attention_head_outputs = unavailable(
        "JetMoE has no single output projection: each token's heads go through its routed experts' projections"
    )


GROUPED = (
    "JetMoE's router hands the experts tokens sorted and grouped by expert, not per-token top-k choices; "
    "read router_logits (its top-k are the choices)"
)


class GroupedExperts(BaseMlp):
    ROUTER = "router"
    ROUTER_LOGITS = 4
    expert_indices = unavailable(GROUPED)
    expert_weights = unavailable(GROUPED)


Layer, Attention, Mlp = classes(__name__, attention=MixtureOfHeads, mlp=GroupedExperts)
ENVOYS = {hf.JetMoeDecoderLayer: Layer, hf.JetMoeAttention: Attention, hf.JetMoeMoE: Mlp}
