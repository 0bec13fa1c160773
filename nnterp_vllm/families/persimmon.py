"""Persimmon (``PersimmonForCausalLM``): the llama containers with ``model.final_layernorm``; attention's ``dense``.

The attention calls the shared interface; the block drops out the MLP's output (``dropout``) before adding it.
"""

from transformers.models.persimmon import modeling_persimmon as hf

from ..components import Attention, Mlp, Value
from ._layouts import classes

RENAME = {"model.layers": "layers", "model.embed_tokens": "embed_tokens", "model.final_layernorm": "norm"}


class PersimmonAttention(Attention):
    OUTPUT_PROJECTION = "dense"


class PersimmonMlp(Mlp):
    mlp_output = Value("../dropout.output", description=Mlp.mlp_output.description)


Layer, Attention, Mlp = classes(__name__, attention=PersimmonAttention, mlp=PersimmonMlp)
ENVOYS = {hf.PersimmonDecoderLayer: Layer, hf.PersimmonAttention: Attention, hf.PersimmonMLP: Mlp}
