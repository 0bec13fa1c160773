"""phi4_multimodal on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import phi4_multimodal
from .._layouts import transformers_backend

transformers_backend(phi4_multimodal, globals())
