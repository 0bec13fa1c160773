"""Granite MoE Shared (``GraniteMoeSharedForCausalLM``): Granite MoE's layout with a shared MLP beside the sparse block.

The sparse block (``block_sparse_moe``) is served as ``mlp``; the block adds the sum of its output
and the shared MLP's (``shared_mlp``, absent when ``shared_intermediate_size`` is 0), times
``residual_multiplier``: the block's ``mlp_output`` is that scaled sum, read where the block's
forward computes it (an assignment), and the sparse block's output alone is not served as what
the block adds. Multipliers as in `granite`.
"""

from nnsight.intervention.envoy import Envoy
from transformers.models.granitemoeshared import modeling_granitemoeshared as hf

from ..components import Mlp as BaseMlp
from ..components import Scaled, Value
from ._layouts import LLAMA_RENAME, classes
from .granite import GraniteLayer, post_head

RENAME = {**LLAMA_RENAME, "block_sparse_moe": "mlp"}
SHARED = (
    "the block adds this sparse block's output plus shared_mlp's, times residual_multiplier; read the block's "
    "mlp_output"
)


class SharedLayer(GraniteLayer):
    SOURCED = True  # the sum is an operation in the block's forward, already running when it is read

    @property
    def MLP_SUM(self) -> str:  # noqa: N802 - a knob, read like the components' class-level names
        """Where the block holds what its MLPs add: the sum in its forward, or the sparse block's output alone."""
        return "source.hidden_states_4" if self._module.shared_mlp is not None else "block_sparse_moe"

    mlp_output = Scaled(
        "{self.MLP_SUM}.output", scale="residual_multiplier", description=GraniteLayer.mlp_output.description
    )


def _beside_shared(mlp: Envoy) -> str | None:
    return SHARED if mlp.parent._module.shared_mlp is not None else None


class SparseMlp(BaseMlp):
    mlp_output = Value(description=BaseMlp.mlp_output.description, unavailable=_beside_shared)


Layer, Attention, Mlp = classes(
    __name__, layer=SharedLayer, mlp=SparseMlp, mlp_names={"ROUTER": "router", "ROUTER_LOGITS": 2}
)
ENVOYS = {
    hf.GraniteMoeSharedDecoderLayer: Layer,
    hf.GraniteMoeSharedAttention: Attention,
    hf.GraniteMoeSharedMoE: Mlp,
}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "post_head"]
