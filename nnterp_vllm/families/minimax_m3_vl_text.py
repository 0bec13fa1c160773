"""MiniMax-M3 text (``MiniMaxM3VLForCausalLM``): the llama layout with block-sparse attention and a sparse ``mlp``.

On ``minimax_m3_sparse`` entries of ``layer_types`` the attention's ``indexer`` picks, per query and
key-value head, ``index_topk_blocks`` blocks of ``index_block_size`` keys from the block's input and
folds that choice into the mask before the attention call: the pattern is zero off the chosen
blocks, and writing the keys does not change which blocks are chosen. ``mlp`` is a dense MLP on the
``dense`` entries of ``mlp_layer_types``, else a sparse block with shared experts whose router
``gate`` returns ``(logits, weights, indices)``.
"""

from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__, mlp_names={"ROUTER": "gate"})
ENVOYS = {
    hf.MiniMaxM3VLDecoderLayer: Layer,
    hf.MiniMaxM3VLAttention: Attention,
    hf.MiniMaxM3VLSparseMoeBlock: Mlp,
    hf.MiniMaxM3VLDenseMLP: Mlp,
}
