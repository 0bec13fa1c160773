"""helium on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import helium
from .._layouts import transformers_backend

transformers_backend(helium, globals())
