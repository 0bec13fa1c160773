"""phi on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import phi
from .._layouts import transformers_backend

transformers_backend(phi, globals())
