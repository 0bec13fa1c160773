"""Granite MoE Shared on vLLM: Granite MoE's blocks with a ``shared_mlp`` beside the sparse block (``mlp``).

The block adds the sparse block's output plus shared_mlp's, times ``residual_multiplier``: its ``mlp_output`` is
that sum, read-only (the block computes it inline); the sparse block's output alone is not what it adds.
"""

from typing import Any

from vllm.model_executor.models import granitemoe as vllm_granitemoe
from vllm.model_executor.models import granitemoeshared as vllm_granitemoeshared

from ...components import vllm as on_vllm
from .._layouts import LLAMA_RENAME, vllm_classes
from ..granite import post_head
from ..granitemoeshared import SparseMlp


def _no_attention(block: Any) -> str | None:
    return None if hasattr(block._module, "self_attn") else "this block has no self_attn module: it is a mamba block"


def _feed_forwards(block: Any) -> tuple[tuple[str, str], ...]:
    """The feed-forwards this block has (the sparse block, shared_mlp), each times the block's multiplier."""
    module = block._module
    present = [name for name in ("block_sparse_moe", "shared_mlp") if getattr(module, name, None) is not None]
    return tuple((f"{name}.output", "residual_multiplier") for name in present)


class SharedLayer(on_vllm.Layer):
    attention_output = on_vllm.FlatScaled(
        "self_attn.output",
        scale="residual_multiplier",
        description=on_vllm.Layer.attention_output.description,
        unavailable=_no_attention,
    )
    mlp_output = on_vllm.Summed(
        _feed_forwards,
        description="The sparse block's and shared_mlp's outputs, summed, times residual_multiplier (read-only)",
    )


class SharedSparseMlp(on_vllm.SparseMlp):
    mlp_output = on_vllm.Flat(
        description=SparseMlp.mlp_output.description, unavailable=SparseMlp.mlp_output.unavailable
    )


RENAME = {**LLAMA_RENAME, "block_sparse_moe": "mlp"}
Layer, Attention, Mlp = vllm_classes(__name__, layer=SharedLayer, mlp=SharedSparseMlp)
ENVOYS = {
    vllm_granitemoeshared.GraniteMoeSharedDecoderLayer: Layer,
    vllm_granitemoe.GraniteMoeAttention: Attention,
    vllm_granitemoe.GraniteMoeMoE: Mlp,
}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "post_head"]
