"""`StandardizedVLLM`: the standardized root over nnsight's `VLLM`, on vLLM's CPU or CUDA build.

The same values, shapes (``[1, seq, ...]`` per invoke: one prompt each) and methods as
`StandardizedTransformer`. Values are copies (vLLM reuses its buffers in place) and
writes go through assignment. The attention pattern lives inside vLLM's fused kernels
and is reported unavailable; ``logits`` covers every position, computed from the final
norm with the model's own head (vLLM itself computes the last position only).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from nnsight.intervention.interleaver import Mediator

from .. import families
from ..components import WHOLE, Derived, Value, first_tensor
from ..components.vllm import Flat, Hidden, flat, gathered
from ..standardized import Standardized, family_gaps
from .vllm_platform import PlatformVLLM, shutdown


class Logits(Derived):
    """Logits at every position, from the final norm through the head.

    Assigning replaces what vLLM samples from: the last position of the assigned
    ``[1, seq, vocab]`` (or ``[1, 1, vocab]``) tensor.
    """

    def __init__(self) -> None:
        super().__init__(
            lambda model: model._post_head(model._unembed(model.final_norm_output)),
            description="The logits [1, seq, vocab]; vLLM samples from the last position",
        )
        self.writable = True

    def __set__(self, model: Any, value: Any) -> None:
        self.check(model)
        last = flat(value, "logits")[-1:]
        Mediator.swap(f"{model.path}.logits", last)


@family_gaps
class StandardizedVLLM(Standardized, PlatformVLLM):
    """A vLLM model with the standardized values and methods.

    Args:
        checkpoint: A local checkpoint directory or a hub id.
        family: A vLLM family module, skipping the lookup by model_type.
        rename: Extra ``{native_path: standard_name}`` aliases; they win over the family's.
        envoys: Extra ``{module type or path: Envoy subclass}`` entries; they win over the family's.
        **kwargs: For nnsight's ``VLLM`` and ``vllm.LLM`` (``dtype``, ``tensor_parallel_size``, ...).
            On vLLM's CPU build the KV cache defaults to 64 MiB. Prefix caching is refused: it
            would share KV state computed under one request's intervention with other requests.

    Sampling settings go to ``trace``/``generate`` as vLLM's (``max_tokens``, ``temperature``) or
    as transformers' (``max_new_tokens``, ``do_sample=False``, ``min_new_tokens``).
    """

    ENGINE = families.VLLM

    token_embeddings = Hidden("embed_tokens.output", description=Standardized.token_embeddings.description)
    final_norm_output = Hidden("norm.output", description=Standardized.final_norm_output.description)
    input_ids = Flat("inputs", select="input_ids", description="The token ids of the prompt [1, seq]")
    attention_mask = Derived(
        lambda model: torch.ones_like(model.input_ids),
        description="All ones [1, seq]: vLLM runs every prompt unpadded",
    )
    logits = Logits()
    lm_head_output = Derived(
        lambda model: model._unembed(model.final_norm_output), description="The head's output [1, seq, vocab]"
    )
    _sampler_logits = Value("logits", select=WHOLE)
    next_token_probs = Derived(
        lambda model: torch.softmax(model._sampler_logits.float(), dim=-1),
        description="Softmax of the logits vLLM samples from [1, vocab]",
    )

    def __init__(
        self,
        checkpoint: Any,
        *,
        family: ModuleType | None = None,
        rename: dict[str, str] | None = None,
        envoys: dict[Any, type] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("enable_prefix_caching"):
            raise ValueError(
                "enable_prefix_caching=True is refused: cached KV state computed under one request's "
                "intervention would be reused by other requests. Leave it off (the default)."
            )
        from nnsight.modeling.vllm.envoys import parallel_envoys

        maps = self._maps(checkpoint, family, rename, envoys, kwargs, parallel_envoys())
        self._tensor_parallel_size = int(kwargs.get("tensor_parallel_size", 1))
        super().__init__(str(checkpoint), **maps, **kwargs)

    @staticmethod
    def _sampling_kwargs(kwargs: dict) -> dict:
        """vLLM's sampling settings, also taking transformers' spellings (``do_sample``, ``min_new_tokens``)."""
        kwargs = PlatformVLLM._sampling_kwargs(kwargs)
        if kwargs.pop("do_sample", None) is False:
            kwargs.setdefault("temperature", 0.0)
        if "min_new_tokens" in kwargs:
            kwargs.setdefault("min_tokens", kwargs.pop("min_new_tokens"))
        return kwargs

    def shutdown(self) -> None:
        """Stop the engine behind this model (idempotent); another can then be built in this process."""
        shutdown(self)

    def _final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        return first_tensor(self.norm(hidden.reshape(-1, shape[-1]))).reshape(shape)

    def _unembed(self, normed: torch.Tensor) -> torch.Tensor:
        # Each tensor-parallel rank holds a slice of the (padded) vocabulary.
        local = torch.nn.functional.linear(normed, self.lm_head._module.weight.to(normed.dtype))
        return gathered(local)[..., : self.vocab_size]

    def _unembedding(self) -> torch.Tensor:
        # The weights live in the engine: fetch the head, whole and unpadded.
        with self.trace(" ", max_tokens=1):
            weight = gathered(self.lm_head._module.weight.t()).t()[: self.vocab_size].clone().save()
        return weight
