"""bitnet on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import bitnet
from .._layouts import transformers_backend

transformers_backend(bitnet, globals())
