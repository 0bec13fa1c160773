"""OPT on vLLM: ``model.decoder.*``, one-tensor blocks with the MLP as two bare linears (``fc1``, ``fc2``)."""

from vllm.model_executor.models import opt as vllm_opt

from ...components import unavailable, vllm_attention
from ...components import vllm as on_vllm
from .._layouts import vllm_classes
from ..opt import RENAME, intermediate_size


class OPTAttention(vllm_attention.Attention):
    OUTPUT_PROJECTION = "out_proj"
    attention_queries = unavailable(
        "transformers' OPT scales the queries by head_dim**-0.5 before the score product and vLLM's kernel scales "
        "the scores instead, so the queries entering the kernel are not transformers' (its keys and values are)"
    )


class OPTLayer(on_vllm.Layer):
    mlp_output = unavailable(
        "transformers' OPT runs its MLP on the tokens flattened, and its family serves fc2's output as [batch * seq, "
        "hidden], so there is no [1, seq, hidden] value to check this one against; read layer_output - layer_input - "
        "attention_output"
    )


Layer, Attention, Mlp = vllm_classes(__name__, layer=OPTLayer, attention=OPTAttention)
ENVOYS = {vllm_opt.OPTDecoderLayer: Layer, vllm_opt.OPTAttention: Attention}
__all__ = ["ENVOYS", "RENAME", "Attention", "Layer", "Mlp", "intermediate_size"]
