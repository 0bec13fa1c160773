"""jais2 on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import jais2
from .._layouts import transformers_backend

transformers_backend(jais2, globals())
