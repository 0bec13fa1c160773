"""RWKV (``RwkvForCausalLM``): ``rwkv.{embeddings, blocks, ln_out}`` and ``head``; each block mixes time, then channels.

The time-mixing recurrence (``attention``) is served as ``mixer`` and the channel mixing
(``feed_forward``) as ``mlp``; each returns its output beside the recurrent state, and the block returns
``(hidden, state, attentions)``, whose first element is the residual stream. The first block layer-norms
the embeddings (``pre_ln``) before adding anything to them, so its ``layer_input`` is ``pre_ln``'s output,
the stream its sublayers add to; ``token_embeddings`` is the table's output. In eval mode the model halves
the stream after every ``rescale_every``-th block, between blocks (its weights are rescaled to match).
"""

from transformers.models.rwkv import modeling_rwkv as hf

from ..components import Layer as BaseLayer
from ..components import Mixer, Mlp, Value

RENAME = {
    "rwkv.embeddings": "embed_tokens",
    "rwkv.blocks": "layers",
    "rwkv.ln_out": "norm",
    "head": "lm_head",
    "attention": "mixer",
    "feed_forward": "mlp",
}


class Layer(BaseLayer):
    """An RWKV block, whose residual stream starts at ``pre_ln``'s output on the first block."""

    @property
    def STREAM_IN(self) -> str:  # noqa: N802 - a key placeholder
        """Where the stream the sublayers add to enters: ``pre_ln``'s output on the first block, else the input."""
        return "pre_ln.output" if hasattr(self._module, "pre_ln") else "input"

    layer_input = Value("{self.STREAM_IN}", description=BaseLayer.layer_input.description)


ENVOYS = {hf.RwkvBlock: Layer, hf.RwkvSelfAttention: Mixer, hf.RwkvFeedForward: Mlp}
