"""flex_olmo on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import flex_olmo
from .._layouts import transformers_backend

transformers_backend(flex_olmo, globals())
