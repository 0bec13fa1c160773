"""OLMo on vLLM's Transformers backend: transformers' OLMo modules around vLLM's kernels."""

from .. import olmo
from .._layouts import transformers_backend

transformers_backend(olmo, globals())
