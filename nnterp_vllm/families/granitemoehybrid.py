"""Granite MoE Hybrid (``GraniteMoeHybridForCausalLM``): the llama layout; mamba-2 or attention blocks, then experts.

Each block's token mixer is a mamba-2 layer (served as ``mixer``) or attention; its feed-forward is a sparse
block (``block_sparse_moe``, served as ``mlp``; its ``router`` returns the logits last) plus a dense
``shared_mlp`` fed the same input. The block adds each sublayer's output times ``residual_multiplier``, so
``mixer_output``/``attention_output`` are the scaled outputs and the block's ``mlp_output`` is the scaled sum
of both feed-forwards (an assignment in the block's forward; shared_mlp's output alone on a checkpoint
without experts); the sparse block's output alone is not what the block adds. Embeddings are scaled by
``embedding_multiplier`` and logits divided by ``logits_scaling`` (see `granite`).
"""

from nnsight.intervention.envoy import Envoy
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf

from ..components import Layer as BaseLayer
from ..components import Mixer as BaseMixer
from ..components import Mlp as BaseMlp
from ..components import Scaled, unavailable
from ..components.attention import model_config
from ._layouts import LLAMA_RENAME, classes
from .granite import post_head

RENAME = {**LLAMA_RENAME, "mamba": "mixer", "block_sparse_moe": "mlp"}


def _residual_multiplier(host: Envoy) -> float:
    return model_config(host).residual_multiplier


def _no_attention(block: Envoy) -> str | None:
    return None if block._module.self_attn is not None else "this block has no self_attn module: it is a mamba block"


class HybridLayer(BaseLayer):
    SOURCED = True  # mlp_output is an assignment inside the block's forward

    @property
    def feed_forward_sum(self) -> str:
        """The assignment holding the feed-forward output: the sparse block's plus shared_mlp's, or shared_mlp's."""
        return "hidden_states_4" if self._module.has_experts else "hidden_states_5"

    attention_output = Scaled(
        "self_attn.output",
        scale=_residual_multiplier,
        description=BaseLayer.attention_output.description,
        unavailable=_no_attention,
    )
    mlp_output = Scaled(
        "source.{self.feed_forward_sum}.output",
        scale=_residual_multiplier,
        description="The feed-forward output, scaled",
    )


class Mixer(BaseMixer):
    mixer_output = Scaled(scale=_residual_multiplier, description=BaseMixer.mixer_output.description)


class SparseMlp(BaseMlp):
    ROUTER = "router"
    ROUTER_LOGITS = 2
    mlp_output = unavailable(
        "the block adds this sparse block's output plus shared_mlp's, times residual_multiplier; "
        "read the block's mlp_output"
    )


Layer, Attention, Mlp = classes(__name__, layer=HybridLayer, mlp=SparseMlp)
ENVOYS = {
    hf.GraniteMoeHybridDecoderLayer: Layer,
    hf.GraniteMoeHybridAttention: Attention,
    hf.GraniteMoeHybridMambaLayer: Mixer,
    hf.GraniteMoeHybridMoE: Mlp,
}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mixer", "Mlp", "post_head"]
