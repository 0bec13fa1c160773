"""Falcon-H1 on vLLM: one-tensor blocks running attention and a mamba-2 scan (``mixer``) in parallel.

The block adds the attention's output times ``attn_out_multiplier`` plus the scan's times ``ssm_out_multiplier``:
``mixer_output`` is that sum (read-only here: the block computes it inline), ``mixer.mixer_output`` the scan's
share of it.
"""

from typing import Any

from vllm.model_executor.models import falcon_h1 as vllm_falcon_h1

from ...components import vllm as on_vllm
from .._layouts import vllm_classes
from ..falcon_h1 import RENAME, ParallelLayer, post_head


class Layer(on_vllm.Layer):
    attention_output = ParallelLayer.attention_output
    mixer_output = on_vllm.Summed(
        ("self_attn.output", "attn_out_multiplier"),
        ("mixer.output", "ssm_out_multiplier"),
        description=ParallelLayer.mixer_output.description,
    )


def _ssm_out_multiplier(mixer: Any) -> float:
    return mixer.parent._module.ssm_out_multiplier


class Mixer(on_vllm.Mixer):
    mixer_output = on_vllm.FlatScaled(scale=_ssm_out_multiplier, description=on_vllm.Mixer.mixer_output.description)


_, Attention, Mlp = vllm_classes(__name__)
ENVOYS = {
    vllm_falcon_h1.FalconH1ParallelHybrid: Layer,
    vllm_falcon_h1.FalconH1AttentionDecoderLayer: Attention,
    vllm_falcon_h1.FalconH1SSMDecoderLayer: Mixer,
    vllm_falcon_h1.FalconH1MLP: Mlp,
}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mixer", "Mlp", "post_head"]
