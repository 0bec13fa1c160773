"""MiniMax (``MiniMaxForCausalLM``): normed-residual blocks whose token mixer is softmax or lightning attention.

``self_attn`` is softmax attention on ``full_attention`` blocks and a lightning (linear) attention on the
others, served as ``mixer``; ``mlp`` is a sparse block with router ``gate``. The block norms the residual
stream itself: ``h = norm(x)``, then ``h = norm(alpha * h + beta * attn(h))``, then ``alpha' * h + beta' *
mlp(h)``, so no sublayer output is what the block adds to its input and ``attention_output``,
``mixer_output`` and ``mlp_output`` are not served on the block; the sublayers' own outputs are, on
``self_attn``, ``mixer`` and ``mlp``.
"""

from transformers.models.minimax import modeling_minimax as hf

from ..components import Layer as BaseLayer
from ..components import Mixer, unavailable
from ._layouts import LLAMA_RENAME, classes

RENAME = {**LLAMA_RENAME, hf.MiniMaxLightningAttention: "mixer"}
NORMED_RESIDUAL = (
    "the block norms the residual stream itself (input_layernorm before the token mixer, "
    "post_attention_layernorm after its sum) and adds each sublayer with factors alpha/beta, "
    "so layer_output != layer_input + mixer + mlp; read self_attn.attention_output, "
    "mixer.mixer_output or mlp.mlp_output for the sublayers' outputs"
)


class NormedResidualLayer(BaseLayer):
    """A block that norms the residual stream itself, so its sublayers' outputs are not its additions."""

    attention_output = unavailable(NORMED_RESIDUAL)
    mixer_output = unavailable(NORMED_RESIDUAL)
    mlp_output = unavailable(NORMED_RESIDUAL)


Layer, Attention, Mlp = classes(__name__, layer=NormedResidualLayer, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.MiniMaxDecoderLayer: Layer,
    hf.MiniMaxAttention: Attention,
    hf.MiniMaxLightningAttention: Mixer,
    hf.MiniMaxSparseMoeBlock: Mlp,
}
