"""seed_oss on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import seed_oss
from .._layouts import transformers_backend

transformers_backend(seed_oss, globals())
