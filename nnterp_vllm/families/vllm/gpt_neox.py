"""gpt_neox on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import gpt_neox
from .._layouts import transformers_backend

transformers_backend(gpt_neox, globals())
