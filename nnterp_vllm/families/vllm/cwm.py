"""cwm on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import cwm
from .._layouts import transformers_backend

transformers_backend(cwm, globals())
