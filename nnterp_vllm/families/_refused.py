"""Model_types in transformers' causal-LM mapping that are refused, each with the reason.

Besides encoders, these are architectures with no single residual stream through one stack of blocks
(recurrent cycles, stacked predictions, byte patches) and models that do not run on a prompt alone.

Encoder-only types reach that mapping through a ``...ForCausalLM`` class that runs the
bidirectional encoder under a causal mask (``is_decoder=True``); encoder-decoder types through
the decoder half alone. Neither is a decoder-only language model whose residual stream the
standardized values describe.
"""

from __future__ import annotations

_ENCODER = (
    "encoder-only: its causal-LM class runs the bidirectional encoder under a causal mask "
    "(is_decoder=True), so checkpoints trained as masked LMs give no language model there; its blocks "
    "add each sublayer and then norm the sum (no residual stream that passes through unchanged), "
    "and its head is a masked-LM transform. Use transformers directly (output_hidden_states) for encoders"
)
_ENCODER_DECODER = (
    "encoder-decoder: its causal-LM class is the decoder half alone, whose blocks are built to "
    "cross-attend to an encoder's output and whose checkpoints are trained with one; a decoder-only "
    "trace has no encoder output to give them. Use transformers directly with the full seq2seq model"
)
_ALTUP = (
    "Gemma-3n carries a stack of AltUp predictions, [altup_num_inputs, batch, seq, hidden], through its "
    "blocks instead of one residual stream"
)
_DRAFT = (
    "a speculative-decoding draft model: its forward needs the target model's input embeddings and shared "
    "key/value states, so it does not run on a prompt by itself"
)
_AUDIO_CODES = (
    "an audio-code decoder: it reads and predicts several codebooks per step, conditioned on a text encoder, "
    "not a token sequence"
)
_OWN = {
    "xlnet": "XLNet is a permutation language model with two attention streams (content and query), not one "
    "residual stream under a causal mask",
    "reformer": "Reformer's blocks are reversible: they carry two half-streams (attention and feed-forward "
    "outputs) concatenated, not one residual stream, and attend with LSH buckets or local chunks",
    "prophetnet": "encoder-decoder (ProphetNet): its decoder predicts n future tokens with an n-stream "
    "self-attention, not one residual stream per position",
    "hrm_text": "HRM runs its blocks in nested recurrent cycles (the low-level module H_cycles x L_cycles times, "
    "the high-level one H_cycles times, on sums of two states), so a block has no single input and output "
    "per forward",
    "gemma3n_text": _ALTUP,
    "gemma3n": _ALTUP,
    "gemma4_assistant": _DRAFT,
    "gemma4_unified_assistant": _DRAFT,
    "musicgen": _AUDIO_CODES,
    "musicgen_melody": _AUDIO_CODES,
    "blt": "BLT is a byte-level patcher: a local encoder, a global transformer over patches and a local decoder, "
    "each with its own blocks and width, not one stack of blocks over one residual stream",
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
    **dict.fromkeys(ENCODERS, _ENCODER),
    **dict.fromkeys(ENCODER_DECODERS, _ENCODER_DECODER),
    **_OWN,
}
