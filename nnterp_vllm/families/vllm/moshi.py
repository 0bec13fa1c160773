"""moshi on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import moshi
from .._layouts import transformers_backend

transformers_backend(moshi, globals())
