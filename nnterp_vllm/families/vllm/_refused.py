"""Model_types with a transformers family that the vLLM engine refuses, each with the reason.

Found by the survey in ``tests/family_coverage.py`` (``--vllm-survey``): each type's tiny checkpoint loaded on
vLLM's CPU build and its values compared with transformers'. A type is here when vLLM has no architecture for it
(neither model code of its own nor a Transformers-backend path that runs it), when the CPU build cannot run it (the
missing kernel or op named as vLLM reports it), or when vLLM computes it otherwise than transformers does.
"""

from __future__ import annotations

_COHERE2_WINDOW = (
    "vLLM's Command-R7B and Command-A models attend config.sliding_window + 1 keys on their sliding-window layers "
    "(its code says: to match the training convention), transformers attends sliding_window, so the engines "
    "disagree from the first sliding-window layer on every prompt longer than the window"
)

REFUSED: dict[str, str] = {
    "cohere2": _COHERE2_WINDOW,
    "cohere2_moe": _COHERE2_WINDOW,
}
