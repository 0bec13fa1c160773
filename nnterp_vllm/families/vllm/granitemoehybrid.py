"""Granite MoE Hybrid on vLLM: Granite MoE Shared's blocks whose token mixer is attention or a mamba-2 ``mixer``."""

from typing import Any

from vllm.model_executor.layers.mamba import mamba_mixer2
from vllm.model_executor.models import granitemoe as vllm_granitemoe
from vllm.model_executor.models import granitemoehybrid as vllm_granitemoehybrid

from ...components import vllm as on_vllm
from .granitemoeshared import RENAME as SHARED_RENAME
from .granitemoeshared import Attention, Layer, Mlp, post_head


def _block_multiplier(mixer: Any) -> float:
    return mixer.parent._module.residual_multiplier


class Mixer(on_vllm.Mixer):
    mixer_output = on_vllm.FlatScaled(scale=_block_multiplier, description=on_vllm.Mixer.mixer_output.description)


RENAME = {**SHARED_RENAME, "mamba": "mixer"}
ENVOYS = {
    vllm_granitemoehybrid.GraniteMoeHybridMambaDecoderLayer: Layer,
    vllm_granitemoehybrid.GraniteMoeHybridAttentionDecoderLayer: Layer,
    vllm_granitemoehybrid.GraniteMoeHybridAttention: Attention,
    vllm_granitemoe.GraniteMoeMoE: Mlp,
    mamba_mixer2.MambaMixer2: Mixer,
}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mixer", "Mlp", "post_head"]
