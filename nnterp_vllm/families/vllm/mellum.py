"""mellum on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import mellum
from .._layouts import transformers_backend

transformers_backend(mellum, globals())
