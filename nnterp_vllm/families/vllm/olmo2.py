"""olmo2 on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import olmo2
from .._layouts import transformers_backend

transformers_backend(olmo2, globals())
