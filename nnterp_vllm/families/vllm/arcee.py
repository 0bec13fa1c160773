"""arcee on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import arcee
from .._layouts import transformers_backend

transformers_backend(arcee, globals())
