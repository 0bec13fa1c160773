"""nanochat on vLLM's Transformers backend: transformers' own modules around vLLM's kernels."""

from .. import nanochat
from .._layouts import transformers_backend

transformers_backend(nanochat, globals())
_LOGITS = (
    "vLLM's logits at every position are recomputed from final_norm_output, which this model's norm, called twice, "
    "does not give (see final_norm_output); read next_token_probs for the logits vLLM samples from"
)
UNAVAILABLE = {**nanochat.UNAVAILABLE, "logits": _LOGITS, "lm_head_output": _LOGITS}
