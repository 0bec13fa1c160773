"""Falcon (``FalconForCausalLM``): BLOOM's containers; attention arithmetic of its own; parallel or sequential blocks.

The parallel block (the default, and every new-architecture checkpoint) adds the attention's output into the MLP's
output tensor in place (``mlp_output += attention_output``), so the MLP's output is served as a copy taken before
that. The attention's own arithmetic is read on its rotary path; the ALiBi path (falcon-rw) is not mapped.

Values are split off before the queries are rotated and next passed to a call where the cache is updated, so keys
and values are read there (after the queries, as on every family): a trace run with ``use_cache=False`` never
reaches them. New-architecture checkpoints repeat keys and values to every query head while splitting the fused
projection, so ``attention_keys``/``attention_values`` have ``num_heads`` heads there.
"""

from typing import Any

from nnsight.intervention.envoy import Envoy
from transformers.models.falcon import modeling_falcon as hf

from ..components import WHOLE, Attention, Mlp, Value
from ._layouts import classes

RENAME = {
    "transformer.word_embeddings": "embed_tokens",
    "transformer.h": "layers",
    "transformer.ln_f": "norm",
    "self_attention": "self_attn",
}


def _interior(attention: Envoy) -> str | None:
    return attention.interior_reason()


def _cached(attention: Envoy) -> str | None:
    if not attention._module.config.use_cache:
        return "read where the model updates its key/value cache, and this checkpoint sets use_cache=False"
    return attention.interior_reason()


def _value(key: str, base: str, select: Any = 0, unavailable: Any = _interior) -> Value:
    return Value(f"source.{key}", select=select, description=vars(Attention)[base].description, unavailable=unavailable)


class FalconAttention(Attention):
    OUTPUT_PROJECTION = "dense"

    def interior_reason(self) -> str | None:
        if self._module.config.alibi:
            return "this checkpoint uses ALiBi (falcon-rw), whose attention path this family does not map"
        return super().interior_reason()

    attention_queries = _value("apply_rotary_pos_emb_0.output", "attention_queries", 0)
    attention_keys = _value("layer_past_update_0.output", "attention_keys", 0, _cached)
    attention_values = _value("layer_past_update_0.output", "attention_values", 1, _cached)
    attention_scores = _value("F_softmax_0.input", "attention_scores")
    attention_probabilities = _value("F_softmax_0.output", "attention_probabilities", WHOLE)
    attention_premix = _value("attn_output_permute_0.output", "attention_premix", WHOLE)


class Copied(Value):
    """A module output the block later edits in place: read as a copy, written back (and written) as a copy."""

    writes_back = True

    def serve(self, host: Envoy, part: Any) -> Any:
        return super().serve(host, part.clone())

    def accept(self, host: Envoy, value: Any) -> Any:
        return super().accept(host, value).clone()


class FalconMlp(Mlp):
    mlp_output = Copied(description=Mlp.mlp_output.description)


Layer, Attention, Mlp = classes(__name__, attention=FalconAttention, mlp=FalconMlp)
ENVOYS = {hf.FalconDecoderLayer: Layer, hf.FalconAttention: Attention, hf.FalconMLP: Mlp}


def num_kv_heads(model: Any) -> int:
    """``num_kv_heads`` on new-architecture checkpoints; one shared head on multi-query ones; else one per head."""
    config = model.config
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else model.num_heads


def intermediate_size(model: Any) -> int:
    """The MLP width is ``ffn_hidden_size``."""
    return model.config.ffn_hidden_size
