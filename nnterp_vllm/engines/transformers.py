"""`StandardizedTransformer`: the standardized root over nnsight's `TransformersModel`."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import torch
from nnsight import TransformersModel

from .. import arguments, dtypes, families, nnterp_options
from ..checkpoints import read_config_with
from ..families import default
from ..remote import checkpoint_key
from ..standardized import SAEs, Standardized, max_positions
from . import saving
from .tensor_parallel import as_distributed_config, check_heads_split, transformers_degree
from .tracing import Tracer, one_forward_pass, refuse_generation_arguments, warn_mediators_wrote_parameters


class StandardizedTransformer(Standardized, TransformersModel):
    """A HuggingFace transformers model with the standardized values and methods.

    Args:
        checkpoint: A local checkpoint directory, a hub id, or a loaded ``PreTrainedModel``.
        family: A family module to serve the model with, skipping the lookup by model_type.
        rename: Extra ``{native_path: standard_name}`` aliases; they win over the family's.
        envoys: Extra ``{module type or path: Envoy subclass}`` entries; they win over the family's.
        saes: SAEs the model holds, one per block (paths of SAELens SAE directories or loaded `SAE`): each
            block one reads serves ``sae_features``, and `clamp` takes them by name (`sae_list` checks them,
            before any weights load).
        **kwargs: For nnsight's ``TransformersModel`` and ``from_pretrained``. Unless given,
            ``attn_implementation="eager"`` (so the attention pattern exists) and
            ``task="text-generation"`` (so nothing asks the hub for it). A checkpoint loads in its own dtype
            (`dtypes`: its config's, else its weights', else float32), as on vLLM, unless ``dtype=`` (or
            ``torch_dtype=``) names another; a loaded model keeps its own. nnterp's options
            (``enable_attention_probs``, ``check_renaming``, ``rename_config``, ``tokenizer_kwargs``, ...)
            are taken with their meaning or refused with the reason (`nnterp_options.take`).
            Tensor parallel (under ``torchrun``, one process per rank): ``tp_plan="auto"``, ``tp_size=N`` or
            ``distributed_config=DistributedConfig(...)``; every value comes back whole on every rank.

    Example::

        model = StandardizedTransformer("path/to/checkpoint")
        with model.trace("The Eiffel Tower is in the city of"):
            resid = model.layers[2].layer_output.save()
            pattern = model.layers[2].self_attn.attention_probabilities.save()
    """

    ENGINE = families.TRANSFORMERS

    def __init__(
        self,
        checkpoint: Any,
        *,
        family: ModuleType | None = None,
        rename: dict[str, str] | None = None,
        envoys: dict[Any, type] | None = None,
        saes: SAEs = None,
        **kwargs: Any,
    ) -> None:
        from nnsight.modeling.tp.envoys import tp_envoys, wants_tensor_parallel

        nnterp = nnterp_options.take(kwargs, self.ENGINE)
        as_distributed_config(kwargs)
        degree = transformers_degree(kwargs)
        config = read_config_with(checkpoint, kwargs)
        if degree > 1:
            check_heads_split(config, degree, replicated_kv=False)
        base = tp_envoys() if wants_tensor_parallel(checkpoint, kwargs) else {}
        maps = self._maps(config, family, nnterp.merged(rename), envoys, base, saes)
        if not isinstance(checkpoint, torch.nn.Module):
            kwargs.setdefault("attn_implementation", "eager")
            _loading_dtype(checkpoint, config, kwargs)
            checkpoint = str(checkpoint)
        else:
            _loaded_dtype(checkpoint, kwargs)
        kwargs.setdefault("task", "text-generation")
        super().__init__(checkpoint, **maps, **kwargs)
        if self.family is default:
            default.check(self)
        nnterp.apply(self)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model's weights compute in (transformers' own answer: its first floating parameter's)."""
        held = getattr(self._module, "dtype", None)
        if isinstance(held, torch.dtype):
            return held
        return next(parameter.dtype for parameter in self._module.parameters() if parameter.is_floating_point())

    def _remoteable_model_key(self) -> str:
        """The checkpoint half of this model's remote key (`remote`): nnsight's, a local directory named by
        its absolute path instead of being looked up on the hub."""
        from nnsight.modeling import huggingface

        if not self.repo_id:
            raise ValueError(
                "this model was given already loaded, with no checkpoint behind it (its config's name_or_path is "
                "empty), so a server cannot load it: build the model from a checkpoint directory or hub id to "
                "send its traces elsewhere"
            )
        if os.path.isdir(os.path.expanduser(self.repo_id)):  # nnsight's cache of the hub's id for each checkpoint
            huggingface._ID_CACHE[self.repo_id] = checkpoint_key(self.repo_id)
        return super()._remoteable_model_key()

    def trace(self, *inputs: Any, **kwargs: Any) -> Any:
        """A trace: one forward pass over the inputs, its body interleaved with it.

        Generation arguments (``max_new_tokens``, ``do_sample``, ``temperature``, any of transformers' or vLLM's
        sampling settings) are refused with ``TypeError``: ``generate`` takes them. (``generate`` runs through
        here too, naming itself as ``fn``.) ``serve=`` (other than None) is refused: a trace server runs vLLM."""
        if kwargs.pop("serve", None) is not None:
            raise ValueError(
                "serve=: a trace server (nnterp-vllm serve --traces) runs its traces on vLLM; send the trace from "
                "StandardizedVLLM(checkpoint), which loads nothing here, or to NDIF with remote=True"
            )
        kwargs.setdefault("tracer_cls", Tracer)
        if kwargs.get("fn") is not None:
            return super().trace(*inputs, **kwargs)
        refuse_generation_arguments(kwargs)
        return one_forward_pass(super().trace(*inputs, **kwargs))

    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        if inputs:
            arguments.prompt(inputs[0], self.vocab_size, "trace", batched=True)
        return super()._batch_size(*inputs, **kwargs)

    def _batch(self, invokes: list, fn: Any) -> tuple:
        batched = super()._batch(invokes, fn)
        forward = batched[1] if len(batched) == 2 and isinstance(batched[1], dict) else {}
        ids = forward.get("input_ids")
        if isinstance(ids, torch.Tensor):
            arguments.prompt_length(ids.shape[-1], max_positions(self.config), "trace")
        return batched

    def interleave(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        mediators = list(self.interleaver.mediators)
        try:
            return super().interleave(fn, *args, **kwargs)
        finally:
            saving.hand_back(mediators)
            warn_mediators_wrote_parameters(self, mediators)


def _loading_dtype(checkpoint: Any, config: Any, kwargs: dict[str, Any]) -> None:
    """Set ``kwargs["dtype"]`` to the dtype ``checkpoint`` (its config ``config``) loads in (`dtypes.load_dtype`),
    the rule vLLM's engines follow too; a quantization name (nnsight's ``dtype="nf4"``, ...) or a per-module dict
    passes as it is."""
    from nnsight.modeling.quantization import quantization

    spelling, value = dtypes.given(kwargs)
    if isinstance(value, dict) or (isinstance(value, str) and quantization(value) is not None):
        kwargs[spelling] = value
        return
    kwargs[spelling] = value
    kwargs["dtype"] = dtypes.load_dtype(checkpoint, config, kwargs, families.TRANSFORMERS)


def _loaded_dtype(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse a ``dtype=`` other than the one an already loaded ``module`` holds (it would not be converted)."""
    spelling, value = dtypes.given(kwargs)
    wanted = dtypes.requested(value, families.TRANSFORMERS, spelling)
    held = getattr(module, "dtype", None)
    if wanted is not None and held is not None and wanted != held:
        raise ValueError(
            f"{spelling}={value!r}: this model is already loaded, in {dtypes.name(held)}, and is not converted; "
            f"convert it first (module.to(torch.{dtypes.name(wanted)})) or pass its checkpoint with {spelling}="
        )
