"""persimmon on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import persimmon
from .._layouts import transformers_backend

transformers_backend(persimmon, globals())
