"""GPT-NeoX-Japanese (``GPTNeoXJapaneseForCausalLM``): GPT-NeoX's containers, a sequential block, ``_attn`` of its own.

The last block's attention returns its output projection's bias apart (``dense_bias``) and the block adds it in
``bias_dropout_add``, so the attention's contribution is read there: the output of that call's dropout.
"""

from typing import Any

from transformers.models.gpt_neox_japanese import modeling_gpt_neox_japanese as hf

from ..components import Layer, Value
from ._layouts import classes
from .gptj import GPTJAttention

RENAME = {
    "gpt_neox_japanese.embed_in": "embed_tokens",
    "gpt_neox_japanese.layers": "layers",
    "gpt_neox_japanese.final_layer_norm": "norm",
    "embed_out": "lm_head",
    "attention": "self_attn",
}


class GPTNeoXJapaneseLayer(Layer):
    SOURCED = True

    attention_output = Value(
        "source.bias_dropout_add_0.source.torch_nn_functional_dropout_0.output",
        description="What the attention adds: its output plus the bias the last block adds apart, dropped out",
    )


# GPT-J's own ``_attn`` call, under other module names.
Layer, Attention, Mlp = classes(
    __name__,
    layer=GPTNeoXJapaneseLayer,
    attention=GPTJAttention,
    PROBABILITIES="self_attention_dropout_0.output",
    OUTPUT_PROJECTION="dense",
)
ENVOYS = {hf.GPTNeoXJapaneseLayer: Layer, hf.GPTNeoXJapaneseAttention: Attention, hf.GPTNeoXJapaneseMLP: Mlp}


def intermediate_size(model: Any) -> int:
    """The MLP width is ``intermediate_multiple_size`` times the hidden size."""
    return int(model.hidden_size * model.config.intermediate_multiple_size)
