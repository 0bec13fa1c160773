"""FlexOlmo (``FlexOlmoForCausalLM``): OLMo-2's post-norm block with a sparse mixture-of-experts block as ``mlp``."""

from transformers.models.flex_olmo import modeling_flex_olmo as hf

from ._layouts import LLAMA_RENAME, PostNormLayer, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, layer=PostNormLayer, mlp_names={"ROUTER": "gate"})
ENVOYS = {hf.FlexOlmoDecoderLayer: Layer, hf.FlexOlmoAttention: Attention, hf.FlexOlmoSparseMoeBlock: Mlp}
