"""nanochat on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import nanochat
from .._layouts import transformers_backend

transformers_backend(nanochat, globals())
