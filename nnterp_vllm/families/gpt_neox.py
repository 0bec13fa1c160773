"""GPT-NeoX / Pythia (``GPTNeoXForCausalLM``): ``gpt_neox.{embed_in, layers, final_layer_norm}`` and ``embed_out``.

The block is parallel (attention and MLP read the same input) unless the config says otherwise.
"""

from transformers.models.gpt_neox import modeling_gpt_neox as hf

from ._layouts import classes

RENAME = {
    "gpt_neox.embed_in": "embed_tokens",
    "gpt_neox.layers": "layers",
    "gpt_neox.final_layer_norm": "norm",
    "embed_out": "lm_head",
    "attention": "self_attn",
}


Layer, Attention, Mlp = classes(__name__, OUTPUT_PROJECTION="dense")
ENVOYS = {hf.GPTNeoXLayer: Layer, hf.GPTNeoXAttention: Attention, hf.GPTNeoXMLP: Mlp}
