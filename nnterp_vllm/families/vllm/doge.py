"""doge on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import doge
from .._layouts import transformers_backend

transformers_backend(doge, globals())
