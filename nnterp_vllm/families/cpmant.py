"""CPM-Ant (``CpmAntForCausalLM``): ``cpmant.encoder.{layers, output_layernorm}``, blocks of residual sublayers.

Each block runs ``self_att`` then ``ffn``, each adding its own residual inside; what they add is the
output of ``self_att.self_attention`` and ``ffn.ffn``. The blocks run over ``prompt_length`` learned
prompt positions placed before the input's tokens, which transformers' outputs drop: the block values
are served at the input's positions, and a write leaves the prompt positions as the model computed them.
"""

from typing import Any

import torch
from transformers.models.cpmant import modeling_cpmant as hf

from .. import components as standard

RENAME = {
    "cpmant.encoder.layers": "layers",
    "cpmant.input_embedding": "embed_tokens",
    "cpmant.encoder.output_layernorm": "norm",
    "self_att.self_attention": "self_attn",
    "ffn.ffn": "mlp",
}
WITH_PROMPT = "runs over the prompt_length learned prompt positions too ([batch, prompt_length + seq, ...])"
UNAVAILABLE = {
    "final_norm_output": f"the final norm {WITH_PROMPT}; read model.layers[-1].layer_output and project_on_vocab",
    "token_embeddings": f"the embedding {WITH_PROMPT} and lacks the segment embedding added next; "
    "read model.layers[0].layer_input",
}

INTERIOR = (
    f"the attention {WITH_PROMPT}: every position attends to every other (no causal mask) with a learned "
    "segment/position bias added to the scores, so the input's rows put weight on the prompt positions and no "
    "[batch, heads, seq, seq] pattern over the input's positions sums to 1; read attention_output, or "
    "transformers' output_attentions (cut to the input's positions)"
)


class AtInput(standard.Value):
    """A stream location served at the input's positions: the trailing ones when the prompt's are present."""

    def serve(self, host: Any, part: Any) -> Any:
        prompt = host.root._module.config.prompt_length
        return super().serve(host, part[:, prompt:] if part.shape[1] > prompt else part)

    def put(self, attribute: str, current: Any, part: Any, select: Any) -> Any:
        whole = self.pick(attribute, current, select)
        merged = torch.cat([whole[:, : whole.shape[1] - part.shape[1]], part.to(whole.dtype)], dim=1)
        return super().put(attribute, current, merged, select)


class Layer(standard.Layer):
    layer_input = AtInput("input", description=standard.Layer.layer_input.description)
    layer_output = AtInput("output", description=standard.Layer.layer_output.description)


class Attention(standard.Attention):
    OUTPUT_PROJECTION = "attention_out"
    attention_output = AtInput("output", description=standard.Attention.attention_output.description)

    def interior_reason(self) -> str | None:
        return INTERIOR


class Mlp(standard.Mlp):
    mlp_output = AtInput("output", description=standard.Mlp.mlp_output.description)


ENVOYS = {hf.CpmAntTransformerBlock: Layer, hf.CpmAntAttention: Attention, hf.CpmAntFeedForward: Mlp}


def intermediate_size(model: Any) -> int:
    """The MLP width is ``dim_ff``."""
    return model.config.dim_ff


def head_dim(model: Any) -> int:
    """One head's width is ``dim_head``."""
    return model.config.dim_head
