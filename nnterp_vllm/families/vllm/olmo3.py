"""olmo3 on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import olmo3
from .._layouts import transformers_backend

transformers_backend(olmo3, globals())
