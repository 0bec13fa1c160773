"""dots.llm1 (``Dots1ForCausalLM``): the llama layout with a sparse ``mlp``.

``mlp`` is a dense MLP on the first ``first_k_dense_replace`` blocks, then a sparse block with shared experts.
"""

from transformers.models.dots1 import modeling_dots1 as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {hf.Dots1DecoderLayer: Layer, hf.Dots1Attention: Attention, hf.Dots1MoE: Mlp, hf.Dots1MLP: Mlp}
