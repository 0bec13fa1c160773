"""Aria text (``AriaTextForCausalLM``): the llama layout with a sparse ``mlp`` on every block.

``mlp`` is a mixture of experts whose ``router`` returns ``(top_k_index, top_k_weights, router_logits)``
and whose shared experts run on every token; the experts module is called as
``experts(hidden, top_k_index, top_k_weights)``.
"""

from transformers.models.aria import modeling_aria as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "router", "ROUTER_LOGITS": 2})
ENVOYS = {hf.AriaTextDecoderLayer: Layer, hf.AriaTextAttention: Attention, hf.AriaTextMoELayer: Mlp}
