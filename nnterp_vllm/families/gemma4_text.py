"""Gemma-4 text (``Gemma4ForCausalLM``): the llama layout with post-sublayer norms and a rescaled stream.

Each block ends by multiplying the whole stream, residual included, by its learned
``layer_scalar`` buffer, after the attention, the feed-forward and (where
``hidden_size_per_layer_input`` is set) a per-layer-input branch were added: no sublayer output
is what the block adds. With ``enable_moe_block`` the router and experts are modules of the block
(``router``, ``experts``), run beside the dense ``mlp``. Sliding and full layers differ in head
width; layers past ``num_kv_shared_layers`` reuse an earlier layer's keys and values (no
``k_proj``/``v_proj``): a write to a layer's ``attention_keys``/``attention_values`` reaches that
layer's attention alone, not the later layers reusing them. Logits are soft-capped where the config says so.
"""

from typing import Any

from nnsight.intervention.envoy import Envoy
from transformers.models.gemma4 import modeling_gemma4 as hf

from ..components import Layer, Value, unavailable
from ..components import Mlp as BaseMlp
from ._layouts import LLAMA_RENAME, classes, softcap

RENAME = LLAMA_RENAME

RESCALED = (
    "the block multiplies its whole output, residual included, by its learned layer_scalar buffer "
    "(layer_output = layer_scalar * (layer_input + attention + mlp [+ per-layer-input branch])), so no sublayer "
    "output is what the block adds and layer_output != layer_input + attention_output + mlp_output; read "
    "post_attention_layernorm.output / post_feedforward_layernorm.output for the sublayers' normed outputs"
)
ROUTED_ON_BLOCK = (
    "the router and experts are modules of the block (layers[i].router, layers[i].experts), run beside this dense "
    "mlp and summed with it after their own norms; read layers[i].router.proj.output for the logits (router output 0 "
    "is their softmax) and layers[i].experts.inputs for the chosen experts and their weights"
)


def _routing_reason(mlp: Envoy) -> str | None:
    if mlp._module.config.enable_moe_block:
        return ROUTED_ON_BLOCK
    return "this checkpoint's feed-forward is dense (enable_moe_block is off): it has no router or experts"


class RescaledLayer(Layer):
    attention_output = unavailable(RESCALED)
    mlp_output = unavailable(RESCALED)


class DenseBranchMlp(BaseMlp):
    """The dense feed-forward branch; any routing lives on the block beside it."""

    router_logits = Value(description=BaseMlp.router_logits.description, unavailable=_routing_reason)
    expert_indices = Value(description=BaseMlp.expert_indices.description, unavailable=_routing_reason)
    expert_weights = Value(description=BaseMlp.expert_weights.description, unavailable=_routing_reason)


Layer, Attention, Mlp = classes(__name__, layer=RescaledLayer, mlp=DenseBranchMlp)
ENVOYS = {hf.Gemma4TextDecoderLayer: Layer, hf.Gemma4TextAttention: Attention, hf.Gemma4TextMLP: Mlp}
post_head = softcap


def num_experts_per_token(model: Any) -> int:
    """``top_k_experts`` (0 on a dense checkpoint)."""
    return model.config.get_text_config().top_k_experts or 0
