"""OLMo-Hybrid (``OlmoHybridForCausalLM``): OLMo-2's post-norm attention blocks beside pre-norm delta-net blocks.

An attention block norms each sublayer's output before adding it (``post_attention_layernorm``,
``post_feedforward_layernorm``): those norms' outputs are its contributions. A linear-attention block
norms each sublayer's input instead and adds its gated delta net (``linear_attn``, served as ``mixer``)
and its MLP as they are.
"""

from transformers.models.olmo_hybrid import modeling_olmo_hybrid as hf

from ..components import Mixer
from ._layouts import LLAMA_RENAME, PostNormLayer, classes

RENAME = {**LLAMA_RENAME, "linear_attn": "mixer"}

Layer, Attention, Mlp = classes(__name__)


class AttentionLayer(Layer, PostNormLayer):
    """The attention block, whose post-norms' outputs are what it adds."""


ENVOYS = {
    hf.OlmoHybridAttentionDecoderLayer: AttentionLayer,
    hf.OlmoHybridLinearAttentionDecoderLayer: Layer,
    hf.OlmoHybridAttention: Attention,
    hf.OlmoHybridGatedDeltaNet: Mixer,
    hf.OlmoHybridMLP: Mlp,
}
