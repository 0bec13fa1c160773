"""zaya on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import zaya
from .._layouts import transformers_backend

transformers_backend(zaya, globals())
