"""Model_types in transformers' causal-LM mapping that are refused, each with the reason.

Encoder-only types reach that mapping through a ``...ForCausalLM`` class that runs the
bidirectional encoder under a causal mask (``is_decoder=True``); encoder-decoder types through
the decoder half alone. Neither is a decoder-only language model whose residual stream the
standardized values describe.
"""

from __future__ import annotations

_ENCODER = (
    "encoder-only ({name}): its causal-LM class runs the bidirectional encoder under a causal mask "
    "(is_decoder=True), so checkpoints trained as masked LMs give no language model there; its blocks "
    "add each sublayer and then norm the sum (no residual stream that passes through unchanged), "
    "and its head is a masked-LM transform. Use transformers directly (output_hidden_states) for encoders"
)
_ENCODER_DECODER = (
    "encoder-decoder ({name}): its causal-LM class is the decoder half alone, whose blocks are built to "
    "cross-attend to an encoder's output and whose checkpoints are trained with one; a decoder-only "
    "trace has no encoder output to give them. Use transformers directly with the full seq2seq model"
)
_OWN = {
    "xlnet": "XLNet is a permutation language model with two attention streams (content and query), not one "
    "residual stream under a causal mask",
    "reformer": "Reformer's blocks are reversible: they carry two half-streams (attention and feed-forward "
    "outputs) concatenated, not one residual stream, and attend with LSH buckets or local chunks",
    "prophetnet": "encoder-decoder (ProphetNet): its decoder predicts n future tokens with an n-stream "
    "self-attention, not one residual stream per position",
}

ENCODERS = (
    "bert bert-generation big_bird camembert data2vec-text electra ernie megatron-bert rembert roberta "
    "roberta-prelayernorm roc_bert roformer xlm xlm-roberta xlm-roberta-xl xmod"
).split()
ENCODER_DECODERS = (
    "bart bigbird_pegasus blenderbot blenderbot-small marian mbart mvp pegasus plbart trocr whisper".split()
)

#: model_type -> why it is refused.
REFUSED: dict[str, str] = {
    **{model_type: _ENCODER.format(name=model_type) for model_type in ENCODERS},
    **{model_type: _ENCODER_DECODER.format(name=model_type) for model_type in ENCODER_DECODERS},
    **_OWN,
}
