"""ministral on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import ministral
from .._layouts import transformers_backend

transformers_backend(ministral, globals())
