"""MiniMax-M2 (``MiniMaxM2ForCausalLM``): the llama layout with a sparse ``mlp`` in every block."""

from transformers.models.minimax_m2 import modeling_minimax_m2 as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {hf.MiniMaxM2DecoderLayer: Layer, hf.MiniMaxM2Attention: Attention, hf.MiniMaxM2SparseMoeBlock: Mlp}
