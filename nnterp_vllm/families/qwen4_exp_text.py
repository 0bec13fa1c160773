"""Qwen4-Exp (``Qwen4ExpForCausalLM``): Qwen3-Next's gated-attention / delta-net blocks on hyper-connected streams.

The residual stream is ``hc_count`` side-by-side copies of the hidden state (``hidden_size`` is their total
width). A block runs each sublayer on a gated mix of the copies and adds its output to every copy with its
own weight: those injections (``injection.flatten(-2)``) are its ``mixer_output``/``mlp_output``. The
``hyper_connection_mixer`` folds the copies into one normed state before the head and is served as ``norm``.
``linear_attn`` is served as ``mixer``; ``attention_premix`` is the gated mix entering ``o_proj``; the scores
include the QSA indexer's token-selection mask; ``mlp`` is sparse (router ``gate``) with a shared expert.
"""

from typing import Any

from nnsight.intervention.envoy import Envoy
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

from ..components import GatedAttention, Mixer, Value
from ..components import Layer as BaseLayer
from ._layouts import LLAMA_RENAME, classes

RENAME = {**LLAMA_RENAME, "linear_attn": "mixer", "model.hyper_connection_mixer": "norm"}
del RENAME["model.norm"]
PLE = (
    "this block first adds its per-layer n-gram embedding (ple) to the stream, so layer_output == "
    "layer_input + ple.output + mixer + mlp here; read ple.output and the sublayers' own outputs"
)


def _injection(index: int, description: str, needs_attention: bool = False) -> Value:
    def reason(block: Envoy) -> str | None:
        if block._module.ple is not None:
            return PLE
        if needs_attention and not hasattr(block._module, "self_attn"):
            return "this block has no self_attn module"
        return None

    return Value(f"source.injection_flatten_{index}.output", description=description, unavailable=reason)


class HyperConnectedLayer(BaseLayer):
    """A block adding each sublayer's output to every stream copy with its own weight."""

    attention_output = _injection(0, "What the attention adds to every stream copy [batch, seq, hc*hidden]", True)
    mixer_output = _injection(0, "What the token mixer adds to every stream copy [batch, seq, hc*hidden]")
    mlp_output = _injection(1, "What the MLP adds to every stream copy [batch, seq, hc*hidden]")


Layer, Attention, Mlp = classes(
    __name__, layer=HyperConnectedLayer, attention=GatedAttention, mlp_names={"ROUTER": "gate"}
)
ENVOYS = {
    hf.Qwen4ExpTextDecoderLayer: Layer,
    hf.Qwen4ExpTextAttention: Attention,
    hf.Qwen4ExpTextGatedDeltaNet: Mixer,
    hf.Qwen4ExpTextSparseMoeBlock: Mlp,
}


def hidden_size(model: Any) -> int:
    """The residual stream's width: ``hc_count`` hyper-connected copies of ``hidden_size``."""
    config = model.config.get_text_config()
    return config.hc_count * config.hidden_size


def intermediate_size(model: Any) -> int:
    """Every MLP is sparse: the width of one expert, ``moe_intermediate_size``."""
    return model.config.get_text_config().moe_intermediate_size
