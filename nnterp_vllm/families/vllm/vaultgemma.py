"""vaultgemma on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import vaultgemma
from .._layouts import transformers_backend

transformers_backend(vaultgemma, globals())
