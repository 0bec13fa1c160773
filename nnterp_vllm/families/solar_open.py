"""Solar Open (``SolarOpenForCausalLM``): the llama layout with a sparse ``mlp`` (shared experts) in every block."""

from typing import Any

from transformers.models.solar_open import modeling_solar_open as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {hf.SolarOpenDecoderLayer: Layer, hf.SolarOpenAttention: Attention, hf.SolarOpenMoE: Mlp}


def intermediate_size(model: Any) -> int:
    """Every block is sparse: the width is each expert's, ``moe_intermediate_size``."""
    return model.config.moe_intermediate_size
