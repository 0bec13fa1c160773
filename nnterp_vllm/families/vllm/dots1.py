"""dots1 on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import dots1
from .._layouts import transformers_backend

transformers_backend(dots1, globals())
