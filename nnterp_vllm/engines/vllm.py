"""`StandardizedVLLM`: the standardized root over nnsight's `VLLM`, on vLLM's CPU or CUDA build.

The same values, shapes (``[1, seq, ...]`` per invoke: one prompt each) and methods as
`StandardizedTransformer`. Values are copies (vLLM reuses its buffers in place) and
writes go through assignment. The attention pattern and a fused mixture of experts' choice,
which vLLM's kernels never materialize, are rebuilt when read (from the kernel's queries and
keys, from the router's logits) and cannot be written; ``logits`` covers every position,
computed from the final norm with the model's own head (vLLM itself computes the last position only).
"""

from __future__ import annotations

import dis
import weakref
from types import CodeType, ModuleType
from typing import Any

import torch
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.errors import raise_deferred as raise_as_nnsight
from nnsight.intervention.interleaver import Mediator, OutOfOrderError
from nnsight.modeling.vllm.serve.backend import LocalServeBackend
from nnsight.modeling.vllm.tracer import VLLMTracer as NNsightVLLMTracer

from .. import arguments, families, nnterp_options
from ..checkpoints import read_config_with
from ..components import WHOLE, Derived, Value, first_tensor
from ..components.values import conform
from ..components.vllm import (
    CHOICE_WRITE,
    ExpertChoice,
    Flat,
    Hidden,
    RoutedEither,
    flat,
    gathered,
)
from ..components.vllm_attention import PATTERN_WRITE, Pattern
from ..errors import UnavailableValue, UnsupportedFamily
from ..remote import (
    TRACE_PATH,
    checkpoint_key,
    load_answer,
    warn_plain_http,
)
from ..standardized import SAEs, Standardized, family_gaps
from . import saving
from .closed import refuse_after_shutdown
from .first_blocks import blocks_to_run
from .lifecycle import shutdown
from .nnsight_vllm import PlatformVLLM
from .tensor_parallel import check_heads_split
from .tracing import (
    PARAMETER_READS,
    OneAtATime,
    one_forward_pass,
    refuse_generation_arguments,
    warn_parameters_written,
)


class VLLMTracer(OneAtATime, NNsightVLLMTracer):
    """nnsight's vLLM tracer, one trace at a time per model; a write the engine cannot take (a value it only
    rebuilds, `rebuilt_values`) is refused before anything runs (`refuse_rebuilt_writes`)."""

    def execute(self, code: CodeType) -> None:
        refuse_rebuilt_writes(self.envoy, code)
        super().execute(code)


#: `rebuilt_values` per model (its envoys' classes do not change once it is built).
_REBUILT: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()


def rebuilt_values(model: Any) -> dict[str, str]:
    """``{value name: why it cannot be written}`` for the values every envoy of ``model`` that has them only
    rebuilds (the attention pattern, the expert choice: read-only on vLLM)."""
    try:
        return _REBUILT[model]
    except (KeyError, TypeError):
        pass
    found: dict[str, str] = {}
    writable: set[str] = set()
    for block in model.layers:
        for envoy in (block, *(getattr(block, name, None) for name in ("self_attn", "mlp"))):
            if not isinstance(envoy, Envoy):
                continue
            for name, value in type(envoy).values().items():
                if isinstance(value, RoutedEither):
                    value = value.chosen(envoy)
                if _unavailable(value, envoy):
                    continue  # not served here (a dense block's expert choice): no write to weigh
                if isinstance(value, Pattern):
                    found[name] = PATTERN_WRITE
                elif isinstance(value, ExpertChoice):
                    found[name] = CHOICE_WRITE
                else:
                    writable.add(name)
    refused = {name: why for name, why in found.items() if name not in writable}
    try:
        _REBUILT[model] = refused
    except TypeError:
        pass
    return refused


def _unavailable(value: Value, envoy: Envoy) -> bool:
    try:
        return bool(value.reason(envoy))
    except Exception:  # noqa: BLE001 - a check that cannot run here is settled in the engine
        return False


def _stored_attributes(code: CodeType) -> set[str]:
    """The attribute names a code object (and the code nested in it) assigns to."""
    names = {instruction.argval for instruction in dis.get_instructions(code) if instruction.opname == "STORE_ATTR"}
    for constant in code.co_consts:
        if isinstance(constant, CodeType):
            names |= _stored_attributes(constant)
    return names


def refuse_rebuilt_writes(model: Any, code: CodeType) -> None:
    """Refuse, before the engine runs, a trace body that assigns a value vLLM only rebuilds (``UnavailableValue``)."""
    refused = rebuilt_values(model)
    written = sorted(_stored_attributes(code) & refused.keys())
    if written:
        raise UnavailableValue(f"{written[0]} cannot be written on vLLM: {refused[written[0]]}")


#: Errors a trace body raises that reach the user with their own class and message, as on transformers
#: (nnsight carries an error out of the engine as a RuntimeError naming the original type).
RAISED_AS_THEMSELVES = {
    error.__name__: error
    for error in (
        ValueError,
        TypeError,
        IndexError,
        AttributeError,
        NotImplementedError,
        UnavailableValue,
        UnsupportedFamily,
        OutOfOrderError,
    )
}


def raise_deferred(error: dict | None) -> None:
    """Re-raise an error a request's trace body raised in the engine: as itself where it is one of
    `RAISED_AS_THEMSELVES` (the engine-side traceback as a note), else as nnsight does."""
    if not error or error.get("is_control_flow"):
        return
    kind = RAISED_AS_THEMSELVES.get(error.get("type_name", ""))
    if kind is None:
        raise_as_nnsight(error)
        return
    raised = kind(error.get("message", ""))
    if error.get("traceback"):
        raised.add_note("Intervention traceback (in the engine):\n" + error["traceback"].rstrip())
    raise raised


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
        location = f"{model.path}.logits"
        sampled = Mediator.value(location)
        last = flat(value, "logits")[-1:]
        Mediator.swap(location, conform(f"{model.path}.logits (its last position)", last, sampled))


#: New tokens a generation makes unless told (vLLM's own default).
GENERATED_TOKENS = 16


class ServedTrace(LocalServeBackend):
    """``trace(..., serve=url, api_key=key)`` on vLLM: nnsight's client of a trace server (``nnterp-vllm serve
    --traces``, or nnsight-serve), handing back what a local trace hands back. An error the trace raised comes
    as itself where a local trace's would (`engines.vllm.raise_deferred`), and a list or dict made before the
    trace and filled in it is filled in place (`saving.fill_originals`), by every invoke in invoke order where the
    server sends each invoke's saves (``"invokes"``: ``nnterp-vllm serve``; nnsight-serve sends them merged).

    The answer is loaded with an allow-list (`remote.load_answer`): nothing in it runs code here. TLS is verified
    (httpx's default; ``SSL_CERT_FILE`` names a certificate authority of one's own), and a key about to go over
    plain HTTP to another machine is warned about once (`remote.warn_plain_http`)."""

    def _send(self, blob: bytes) -> list[dict[str, Any]]:
        import httpx
        from nnsight.modeling.vllm.serve import http

        warn_plain_http(self.host, self.api_key)
        with httpx.Client(timeout=http.timeout()) as client:
            response = client.post(self.host + TRACE_PATH, content=blob, headers=http.headers(self.api_key))
        http.check(response)
        result = load_answer(response.content)
        raise_deferred(result.get("error"))
        return result.get("invokes") or [result.get("saves", {})]

    def _push(self, invokes: list[dict[str, Any]], tracer: Any) -> None:
        merged: dict[str, Any] = {}
        lengths: dict[int, int] = {}
        for saves in invokes:
            if tracer.info.frame is not None:
                saving.fill_originals(tracer.info.frame.f_locals, saves, lengths)
            saves.pop(saving.WRITTEN, None)
            merged.update(saves)
        super()._push(merged, tracer)


def _as_transformers(kwargs: dict[str, Any], tokens: int) -> dict[str, Any]:
    """Sampling settings with transformers' defaults where the caller named none: greedy, ``tokens`` new tokens."""
    kwargs = dict(kwargs)
    if not {"max_tokens", "max_new_tokens"} & kwargs.keys():
        kwargs["max_tokens"] = tokens
    if not {"temperature", "do_sample"} & kwargs.keys():
        kwargs["temperature"] = 0.0
    return kwargs


@family_gaps
class StandardizedVLLM(Standardized, PlatformVLLM):
    """A vLLM model with the standardized values and methods.

    Args:
        checkpoint: A local checkpoint directory or a hub id.
        family: A vLLM family module, skipping the lookup by model_type.
        rename: Extra ``{native_path: standard_name}`` aliases; they win over the family's.
        envoys: Extra ``{module type or path: Envoy subclass}`` entries; they win over the family's.
        saes: SAEs the model holds, one per block (paths of SAELens SAE directories or loaded `SAE`), as on
            transformers; checked before the engine starts. They travel into vLLM's workers by directory and digest.
        **kwargs: For nnsight's ``VLLM`` and ``vllm.LLM`` (``dtype``, ``tensor_parallel_size``, ...).
            The model loads in the checkpoint's own dtype, as on transformers (`dtypes`: its config's, else
            its weights', else float32; never vLLM's ``"auto"`` step down from float32 to bfloat16), unless
            ``dtype=`` (or ``torch_dtype=``) names another.
            On vLLM's CPU build the KV cache defaults to 64 MiB. ``tensor_parallel_size=N`` splits the model
            over N ranks (refused where its heads do not split N ways); ``distributed_executor_backend="ray"``
            runs them on Ray (``ray_address=`` or ``RAY_ADDRESS``, else a private cluster). Prefix caching is
            refused: it would share KV state computed under one request's intervention with other requests.
            nnterp's options are taken with their meaning or refused with the reason (`nnterp_options.take`;
            ``enable_attention_probs`` changes nothing: the pattern is rebuilt from the kernel's queries and keys
            when read).

    Sampling settings go to ``generate`` as vLLM's (``max_tokens``, ``temperature``) or as transformers'
    (``max_new_tokens``, ``do_sample=False``, ``min_new_tokens``); ``trace`` is one forward pass and refuses them.
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
        saes: SAEs = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("enable_prefix_caching"):
            raise ValueError(
                "enable_prefix_caching=True is refused: cached KV state computed under one request's "
                "intervention would be reused by other requests. Leave it off (the default)."
            )
        from nnsight.modeling.vllm.envoys import parallel_envoys

        nnterp = nnterp_options.take(kwargs, self.ENGINE)
        config = read_config_with(checkpoint, kwargs)
        maps = self._maps(config, family, nnterp.merged(rename), envoys, parallel_envoys(), saes)
        self._tensor_parallel_size = int(kwargs.get("tensor_parallel_size", 1))
        check_heads_split(config, self._tensor_parallel_size, replicated_kv=True)
        super().__init__(str(checkpoint), checkpoint_config=config, **maps, **kwargs)
        nnterp.apply(self)
        #: How many blocks each forward runs: all, unless built with ``additional_config={FIRST_BLOCKS: n}``
        #: (`run_first_blocks`: values past them, the final norm and the logits included, are then the cut model's).
        self.blocks_run = blocks_to_run(kwargs.get("additional_config"), self.num_layers)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model runs in: the engine's (its weightless tree's before it is dispatched)."""
        engine = self.vllm_entrypoint
        config = getattr(engine, "vllm_config", None) or getattr(
            getattr(engine, "llm_engine", None), "vllm_config", None
        )
        if config is not None:
            return config.model_config.dtype
        return next(parameter.dtype for parameter in self._module.parameters() if parameter.is_floating_point())

    @staticmethod
    def _sampling_kwargs(kwargs: dict) -> dict:
        """vLLM's sampling settings, also taking transformers' spellings (``do_sample``, ``min_new_tokens``)."""
        kwargs = PlatformVLLM._sampling_kwargs(kwargs)
        if kwargs.pop("do_sample", None) is False:
            kwargs.setdefault("temperature", 0.0)
        if "min_new_tokens" in kwargs:
            kwargs.setdefault("min_tokens", kwargs.pop("min_new_tokens"))
        return kwargs

    def trace(self, *inputs: Any, **kwargs: Any) -> Any:
        """A trace, as on transformers: one forward pass over the prompt (one greedy token sampled).

        Generation arguments (``max_tokens``, ``temperature``, ``max_new_tokens``, any of vLLM's or transformers'
        sampling settings) are refused with ``TypeError``: ``generate`` takes them. Refused with `EngineShutDown`
        after `shutdown`."""
        refuse_generation_arguments(kwargs)
        return one_forward_pass(self._tracer(*inputs, **_as_transformers(kwargs, tokens=1)))

    def _tracer(self, *inputs: Any, **kwargs: Any) -> Any:
        """nnsight's trace of ``inputs`` with sampling settings ``kwargs``, on the tracer of this library."""
        refuse_after_shutdown(self, "StandardizedVLLM")
        kwargs.setdefault("tracer_cls", VLLMTracer)
        if kwargs.get("serve") is not None and kwargs.get("backend") is None:
            kwargs["backend"] = ServedTrace(self, kwargs.pop("serve"), api_key=kwargs.pop("api_key", None))
        return super().trace(*inputs, **kwargs)

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """Generation, greedy unless ``temperature``/``do_sample`` say otherwise, as transformers' defaults are;
        ``GENERATED_TOKENS`` new tokens unless ``max_new_tokens``/``max_tokens`` say otherwise."""
        from nnsight.tracing.tracer import WithBlockNotFoundError

        kwargs = _as_transformers(kwargs, tokens=GENERATED_TOKENS)
        tracer = self._tracer(*inputs, **kwargs)
        try:
            # nnsight's test for a `with` block at the caller (read two frames up, so it stays here).
            tracer.capture()
        except WithBlockNotFoundError:
            return self._generate(*inputs, **kwargs)
        return tracer

    def edit(self, *, serve: str | None = None, api_key: str | None = None, **kwargs: Any) -> Any:
        """nnsight's ``edit`` (a block every later trace runs; ``serve=url`` leaves it on a trace server, for the
        traces sent with the same key); a key about to go over plain HTTP to another machine is warned about
        once (`remote.warn_plain_http`)."""
        warn_plain_http(serve, api_key)
        return super().edit(serve=serve, api_key=api_key, **kwargs)

    def _remoteable_model_key(self) -> str:
        """The checkpoint half of this model's remote key (`remote`): a local directory's absolute path, or
        the hub id."""
        return checkpoint_key(self.args[0])

    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        if inputs:
            arguments.prompt(inputs[0], self.vocab_size, "invoke", batched=False)
        return super()._batch_size(*inputs, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        from vllm.exceptions import VLLMValidationError

        try:
            return super()._call(*args, **kwargs)
        except VLLMValidationError as error:  # refused before any request ran (vLLM aborts what it added)
            raise ValueError(f"invoke: {error}") from None

    def _collect(self, mediators: list, outputs: list) -> None:
        """nnsight's collect, with containers filled in place and the library's errors raised as themselves;
        a parameter a trace body wrote in the engine is warned about (`tracing.warn_parameters_written`)."""
        warn_parameters_written(self, saving.take(outputs, PARAMETER_READS))
        saving.fill_from_outputs(mediators, outputs)
        errors = [getattr(output, "nnsight_error", None) for output in outputs]
        for output in outputs:
            output.nnsight_error = None
        try:
            PlatformVLLM._collect(mediators, outputs)
        finally:
            saving.hand_back(mediators)
        for error in errors:
            raise_deferred(error)

    def shutdown(self) -> None:
        """Stop the engine behind this model (idempotent); another can then be built in this process.

        A trace or generation afterwards raises `EngineShutDown`."""
        shutdown(self)
        self._shut_down = True

    def _final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        return first_tensor(self.norm(hidden.reshape(-1, shape[-1]))).reshape(shape)

    def _unembed(self, normed: torch.Tensor) -> torch.Tensor:
        # Each tensor-parallel rank holds a slice of the (padded) vocabulary.
        local = torch.nn.functional.linear(normed, self.lm_head._module.weight.to(normed.dtype))
        return gathered(local)[..., : self.vocab_size]

    def _unembedding(self) -> torch.Tensor:
        # The weights live in the engine: fetch the head, whole and unpadded.
        with self.trace(" "):
            weight = gathered(self.lm_head._module.weight.t()).t()[: self.vocab_size].clone().save()
        return weight
