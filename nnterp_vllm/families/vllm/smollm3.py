"""smollm3 on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import smollm3
from .._layouts import transformers_backend

transformers_backend(smollm3, globals())
