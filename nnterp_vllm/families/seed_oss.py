"""Seed-OSS (``SeedOssForCausalLM``): the llama layout."""

from transformers.models.seed_oss import modeling_seed_oss as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.SeedOssDecoderLayer: Layer, hf.SeedOssAttention: Attention, hf.SeedOssMLP: Mlp}
