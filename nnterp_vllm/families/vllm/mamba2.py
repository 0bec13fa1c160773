"""Mamba-2 on vLLM: blocks passing ``(hidden, residual)``, each a norm and a ``mixer`` (vLLM's mamba-2 scan)."""

from vllm.model_executor.layers.mamba import mamba_mixer2
from vllm.model_executor.models import mamba2 as vllm_mamba2

from ...components import vllm as on_vllm
from ..mamba import BACKBONE_RENAME

RENAME = BACKBONE_RENAME
ENVOYS = {vllm_mamba2.Mamba2DecoderLayer: on_vllm.DualStreamLayer, mamba_mixer2.MambaMixer2: on_vllm.Mixer}
