"""GIT (``GitForCausalLM``): ``git.{embeddings, encoder.layer}``, BERT's post-norm blocks, no final norm.

The block computes ``n = LayerNorm(x + dense(attention(x)))`` (``attention.output``) and
``LayerNorm(n + dense(intermediate(n)))`` (its ``output``): the residual stream itself is normed after each
sublayer is added, so no sublayer output is what the block adds, and ``attention_output``/``mlp_output`` are
not served on the block. ``self_attn`` is the whole ``attention`` module; its ``attention_output`` is the
attention's own projected output (``attention.output.dense``), before the add and the norm. The attention does
its own arithmetic (``attention.self``), read there: queries, keys and values as each is split into heads
(the current tokens', before a cache adds earlier ones), the mix of the values heads first.

nnsight serves a child named ``output`` as ``E_output``: the head is the root's ``E_output`` (the
unembedding, in place of ``lm_head``), and a block's ``E_output`` is its MLP's projection and second
add-and-norm. ``embed_tokens`` is the whole embeddings module (word and position tables, then a LayerNorm),
whose output is what the first block receives: the forward adds the positions in place to the word table's
output, so that output cannot be read as it was. A text prompt has no image tokens.
"""

from typing import Any

import torch
from nnsight.intervention.envoy import Envoy
from transformers.models.git import modeling_git as hf

from ..components import WHOLE, Attention, Layer, Value, unavailable
from ._layouts import classes

RENAME = {"git.embeddings": "embed_tokens", "git.encoder.layer": "layers", "attention": "self_attn"}
UNEMBEDDING = "E_output"
NO_FINAL_NORM = "GIT has no final norm: the last block's output (normed by its own LayerNorm) goes to the head"
UNAVAILABLE = {"final_norm_output": NO_FINAL_NORM + "; read layers[-1].layer_output"}
POST_NORM = (
    "the block norms the residual stream after adding each sublayer (LayerNorm(x + attention), "
    "LayerNorm(n + mlp)), so layer_output != layer_input + attention + mlp; read self_attn.attention_output "
    "for the attention's own output, and the block's E_output.dense output for the MLP's"
)


class GitLayer(Layer):
    attention_output = unavailable(POST_NORM)
    mlp_output = unavailable(POST_NORM)


def described(name: str) -> str:
    """The standard description of an `Attention` value."""
    return vars(Attention)[name].description


class GitAttention(Attention):
    PREMIX = "self.source.torch_matmul_1.output"  # heads first, as the product returns it
    PREMIX_HEADS_FIRST = True

    def interior_reason(self) -> str | None:
        return None  # one code path: GIT's attention has only its eager implementation

    @property
    def output_projection(self) -> Envoy:
        """The attention's output projection, ``output.dense`` (the ``output`` child is ``E_output``)."""
        return self.E_output.dense

    _projection_output = Value("E_output.dense.output")
    attention_output = Value("E_output.dense.output", description=described("attention_output"))
    attention_queries = Value("self.source.transpose_0.output", description=described("attention_queries"))
    attention_keys = Value("self.source.transpose_1.output", description=described("attention_keys"))
    attention_values = Value("self.source.transpose_2.output", description=described("attention_values"))
    attention_scores = Value("self.source.nn_functional_softmax_0.input", description=described("attention_scores"))
    attention_probabilities = Value(
        "self.source.self_dropout_0.output", select=WHOLE, description=described("attention_probabilities")
    )


Layer, Attention, Mlp = classes(__name__, layer=GitLayer, attention=GitAttention)
ENVOYS = {hf.GitLayer: Layer, hf.GitAttention: Attention}


def final_norm(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The stream as it is: the model has no final norm."""
    return hidden
