"""gemma4_unified_text on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import gemma4_unified_text
from .._layouts import transformers_backend

transformers_backend(gemma4_unified_text, globals())
