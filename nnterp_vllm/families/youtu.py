"""Youtu (``YoutuForCausalLM``): the llama layout with multi-head latent attention (DeepSeek-style).

Keys and values are expanded from a compressed latent to every head before transformers' shared
attention call, so they have ``num_heads`` heads; queries and keys are ``qk_nope_head_dim +
qk_rope_head_dim`` wide, values and the per-head mix ``v_head_dim`` wide.
"""

from typing import Any

from transformers.models.youtu import modeling_youtu as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.YoutuDecoderLayer: Layer, hf.YoutuAttention: Attention, hf.YoutuMLP: Mlp}


def head_dim(model: Any) -> int:
    """The width of each head's values and mix (``v_head_dim``); the config's ``head_dim`` is the rotary part."""
    return model.config.get_text_config().v_head_dim


def num_kv_heads(model: Any) -> int:
    """Every head gets its own keys and values, expanded from the shared latent."""
    return model.num_heads
