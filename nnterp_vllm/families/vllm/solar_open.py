"""solar_open on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import solar_open
from .._layouts import transformers_backend

transformers_backend(solar_open, globals())
