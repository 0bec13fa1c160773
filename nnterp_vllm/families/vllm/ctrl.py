"""CTRL on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import ctrl
from .._layouts import transformers_backend

transformers_backend(ctrl, globals())
UNAVAILABLE = {
    "token_embeddings": (
        "CTRL scales the embeddings by sqrt(hidden_size) in place after the embedding module returns them, and vLLM "
        "serves a copy taken before that; read layers[0].layer_input for the scaled stream"
    )
}
