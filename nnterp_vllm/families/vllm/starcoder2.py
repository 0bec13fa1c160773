"""starcoder2 on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import starcoder2
from .._layouts import transformers_backend

transformers_backend(starcoder2, globals())
