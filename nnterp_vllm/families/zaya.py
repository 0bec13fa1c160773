"""ZAYA (``ZayaForCausalLM``): the llama layout with rescaled residual streams and a sparse ``mlp``.

After each sublayer the block rescales the residual stream itself, ``(sublayer + b) * s +
(residual + b') * s'`` with learned per-channel ``b, s, b', s'`` (``post_attention_residual_scale``,
``post_mlp_residual_scale``), so no sublayer output is what the block adds. The attention's queries
and keys come out of a causal convolution (``qkv_proj``) and an L2 norm before the attention call.
The router (``gate``) scores one more class than there are experts, a skip expert: a token routed
to it is sent to expert 0 with weight 0, and the logits are not one per expert.
"""

from typing import Any

from transformers.models.zaya import modeling_zaya as hf

from ..components import Layer as BaseLayer
from ..components import Mlp as BaseMlp
from ..components import unavailable
from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

RESCALED = "the block rescales the residual stream itself after the {0} ((output + b) * s + (residual + b') * s', " + (
    "post_{1}_residual_scale), so no single tensor is what the {0} adds; read {2} for the sublayer's own output"
)


class RescaledLayer(BaseLayer):
    attention_output = unavailable(RESCALED.format("attention", "attention", "self_attn.attention_output"))
    mlp_output = unavailable(RESCALED.format("MLP", "mlp", "mlp.mlp_output"))


class SkipMlp(BaseMlp):
    router_logits = unavailable(
        "the router scores num_experts + 1 classes, the last a skip expert that gives a token no expert output, "
        "so its logits are [tokens, num_experts + 1], not one per expert; read mlp.gate's output[0] for them"
    )


Layer, Attention, Mlp = classes(__name__, layer=RescaledLayer, mlp=SkipMlp, mlp_names={"ROUTER": "gate"})
ENVOYS = {hf.ZayaDecoderLayer: Layer, hf.ZayaAttention: Attention, hf.ZayaSparseMoeBlock: Mlp}


def intermediate_size(model: Any) -> int:
    """Every block is sparse: the width is each expert's, ``moe_intermediate_size``."""
    return model.config.moe_intermediate_size
