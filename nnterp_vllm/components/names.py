"""The names of the standardized values, as the harvest and the capture select them, in one place.

A block value is named by its key under the block (``layer_output``; ``self_attn.attention_queries`` for a module's
value); a root value by its own name. Adding a value is adding its descriptor (`values`, `layer`, `attention`,
`mlp`), its name here, and the families that serve it.
"""

#: Root values that are per token (the others are per prompt or are the inputs themselves).
ROOT_BEFORE_LAYERS = ("token_embeddings",)
ROOT_AFTER_LAYERS = ("final_norm_output", "lm_head_output", "logits")
#: Block values in the order a forward reaches them.
BLOCK_ORDER = (
    "layer_input",
    "self_attn.attention_input",
    "self_attn.attention_queries",
    "self_attn.attention_keys",
    "self_attn.attention_values",
    "self_attn.attention_scores",
    "self_attn.attention_probabilities",
    "self_attn.attention_premix",
    "self_attn.attention_head_outputs",
    "self_attn.attention_output",
    "attention_output",
    "mixer.mixer_output",
    "mixer_output",
    "mlp.mlp_input",
    "mlp.router_logits",
    "mlp.expert_indices",
    "mlp.expert_weights",
    "mlp.mlp_output",
    "mlp_output",
    "layer_output",
    "sae_features",
)
#: Block values a selector may name without their module: ``layers.3.attention_input``.
SHORT_NAMES = {"attention_input": "self_attn.attention_input", "mlp_input": "mlp.mlp_input"}
#: Values laid out ``[batch, heads, seq, ...]`` rather than ``[batch, seq, ...]``.
HEADS_FIRST = {"attention_queries", "attention_keys", "attention_values", "attention_scores", "attention_probabilities"}
#: Values with a key axis as long as the row: padded to the context length on disk.
PATTERNS = {"attention_scores", "attention_probabilities"}
#: Values inside the attention computation: only eager attention exposes them all.
ATTENTION_INTERIOR = {
    "attention_queries",
    "attention_keys",
    "attention_values",
    "attention_scores",
    "attention_probabilities",
    "attention_premix",
    "attention_head_outputs",
}
#: Root values a selector may name.
ROOT_VALUES = (*ROOT_BEFORE_LAYERS, *ROOT_AFTER_LAYERS)
#: Values that are, by meaning, one module's output (SAELens hooks a transformers model by module).
MODULE_OUTPUTS = {
    "layer_output",
    "attention_output",
    "self_attn.attention_output",
    "mlp_output",
    "mlp.mlp_output",
    "token_embeddings",
    "final_norm_output",
    "lm_head_output",
}
#: Block values the engine keeps, by their harvest key: each a ``[tokens, hidden]`` stream at a module.
STATIC_BLOCK_VALUES = (
    "layer_input",
    "self_attn.attention_input",
    "self_attn.attention_output",
    "attention_output",
    "mixer.mixer_output",
    "mixer_output",
    "mlp.mlp_input",
    "mlp.mlp_output",
    "mlp_output",
    "layer_output",
)
#: Root values the engine keeps.
STATIC_ROOT_VALUES = ("token_embeddings", "final_norm_output")
STATIC_VALUES = STATIC_ROOT_VALUES + STATIC_BLOCK_VALUES
#: The features of an SAE the engine holds (``saes=[...]``), encoded from the block's kept ``layer_output`` rows.
SAE_FEATURES = "sae_features"
