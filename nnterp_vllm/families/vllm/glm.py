"""glm on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import glm
from .._layouts import transformers_backend

transformers_backend(glm, globals())
