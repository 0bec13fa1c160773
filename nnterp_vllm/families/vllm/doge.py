"""doge on vLLM's Transformers backend: transformers' own modules around vLLM's kernels.

Doge adds a dynamic mask to its scores (``exp(A * softplus(dt_proj(values)))`` per key, transformers'
``prepare_dynamic_mask``), which vLLM's kernel does not take: the scores and pattern the kernel computes are not
transformers', so they are not served.
"""

from ...components import unavailable
from .. import doge
from .._layouts import transformers_backend

transformers_backend(doge, globals())

DYNAMIC_MASK = (
    "transformers' Doge adds a dynamic mask computed from the values (exp(A * softplus(dt_proj(v))) per key) to the "
    "scores, which vLLM's attention kernel does not take, so the pattern vLLM computes is not transformers'"
)
for _name in ("attention_scores", "attention_probabilities"):
    _value = unavailable(DYNAMIC_MASK)
    _value.name = _name
    setattr(Attention, _name, _value)  # noqa: F821 - bound by transformers_backend
