"""hunyuan_v1_moe on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import hunyuan_v1_moe
from .._layouts import transformers_backend

transformers_backend(hunyuan_v1_moe, globals())
