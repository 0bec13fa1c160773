"""hunyuan_v1_dense on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import hunyuan_v1_dense
from .._layouts import transformers_backend

transformers_backend(hunyuan_v1_dense, globals())
