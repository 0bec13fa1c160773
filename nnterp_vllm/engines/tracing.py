"""How a trace runs on either engine: one at a time per model, whatever the thread, handing back what it saved.

Misuses that would break a model (on vLLM: kill its engine) are refused with the fix: a trace opened
inside a running trace, and ``.stop()`` called on a value. Mistakes nnsight lets pass without a word are
made loud, the same on both engines:

- generation arguments given to a trace (one forward pass, which would ignore them) raise ``TypeError``
  before anything runs, naming ``generate``;
- a trace (or invoke) built and never run warns `TraceNeverRan` when it is discarded, naming the line
  that built it, once per line;
- a write to a model parameter in a trace body warns `ParameterWritten` once per parameter (the write
  stays for every later run of the model), and assigning a parameter through the model, which nnsight
  would only bind on its envoy, is refused.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import warnings
import weakref
from collections.abc import Iterable
from types import CodeType
from typing import Any

import nnsight
import torch
from greenlet import getcurrent
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.tracer import InterleavingTracer, Invoker
from nnsight.intervention.util import shared_locals
from nnsight.tracing.tracer import mark, push_result

from ..errors import ParameterWritten, TraceNeverRan
from ..standardized import Standardized
from .saving import hand_back_shared

_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()

NESTED_TRACE = (
    "a trace cannot be opened inside a running trace: the body of `with model.trace(...)` runs inside the "
    "model's forward pass (on vLLM inside its engine), where no second pass can start. Open the second trace "
    "after the first one ends, or run several prompts in one trace with `tracer.invoke(prompt)`"
)
#: How an AttributeError names a missing ``stop`` (raised here, or carried back from vLLM's engine as text).
_NO_STOP = re.compile(r"'(\w+)' object has no attribute 'stop'")


def model_lock(model: Any) -> threading.RLock:
    """The lock a model's traces run under (re-entrant: a trace may open another on the same model)."""
    with _GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


def in_a_trace_body() -> bool:
    """Whether the caller runs as a trace's body (nnsight runs every body in a greenlet holding its mediator)."""
    return getattr(getcurrent(), "mediator", None) is not None


def clearer_stop_error(error: AttributeError) -> AttributeError:
    """``error`` itself, or, where it says a value has no ``stop``, one that says how a forward pass stops early."""
    found = _NO_STOP.search(str(error))
    if found is None:
        return error
    return AttributeError(
        f"a value has no .stop() (here it is a plain {found.group(1)}): to end the forward pass early, call the "
        "tracer's stop() after the last value you need, e.g. "
        "`with model.trace(prompt) as tracer: out = model.layers[2].output.save(); tracer.stop()`"
    )


# -- generation arguments --------------------------------------------------------------------------------------

#: What transformers' ``generate`` takes (its ``GenerationConfig`` fields and its own parameters), less what a
#: forward pass takes too (``use_cache``, ``output_attentions``, ``output_hidden_states``) and ``max_length``,
#: which a text prompt's tokenizer reads as its truncation length.
TRANSFORMERS_GENERATION = frozenset(
    "assistant_confidence_threshold assistant_early_exit assistant_ensemble_weight assistant_lookbehind "
    "assistant_model assistant_tokenizer bad_words_ids begin_suppress_tokens bos_token_id cache_config "
    "cache_implementation compile_config constraints continuous_batching_config custom_generate "
    "decoder_start_token_id disable_compile diversity_penalty do_sample dola_layers early_stopping "
    "encoder_no_repeat_ngram_size encoder_repetition_penalty eos_token_id epsilon_cutoff eta_cutoff "
    "exponential_decay_length_penalty force_words_ids forced_bos_token_id forced_eos_token_id generation_config "
    "guidance_scale is_assistant length_penalty logits_processor low_memory max_cache_len "
    "max_matching_ngram_size max_new_tokens max_time min_length min_new_tokens min_p "
    "negative_prompt_attention_mask negative_prompt_ids no_repeat_ngram_size num_assistant_tokens "
    "num_assistant_tokens_schedule num_beam_groups num_beams num_return_sequences output_logits output_scores "
    "pad_token_id penalty_alpha prefill_chunk_size prefix_allowed_tokens_fn prompt_lookup_num_tokens "
    "remove_invalid_values renormalize_logits repetition_penalty return_dict_in_generate sequence_bias "
    "speculation_type stop_strings stopping_criteria streamer suppress_tokens synced_gpus target_lookbehind "
    "temperature token_healing top_h top_k top_p typical_p use_mtp watermarking_config".split()
)
#: vLLM's sampling settings (the public fields of ``SamplingParams``).
VLLM_SAMPLING = frozenset(
    "allowed_token_ids bad_words detokenize extra_args flat_logprobs frequency_penalty ignore_eos "
    "include_stop_str_in_output logit_bias logprob_token_ids logprobs max_tokens min_p min_tokens n output_kind "
    "output_text_buffer_length presence_penalty prompt_logprob_start prompt_logprob_token_ids prompt_logprobs "
    "repetition_detection repetition_penalty routed_experts_prompt_start seed skip_clone "
    "skip_reading_prefix_cache skip_special_tokens spaces_between_special_tokens stop stop_token_ids "
    "stream_interval structured_outputs temperature thinking_token_budget top_k top_p trace_decode_token_ids "
    "watermarking".split()
)
#: What a trace refuses on either engine: any argument that makes a run generate, whichever engine spells it.
GENERATION_ARGUMENTS = TRANSFORMERS_GENERATION | VLLM_SAMPLING


def refuse_generation_arguments(kwargs: dict[str, Any], invoke: bool = False) -> None:
    """Raise ``TypeError`` where ``kwargs``, given to a trace (or to one of its invokes), hold generation arguments:
    a trace runs one forward pass and would ignore them (on transformers) or generate anyway (on vLLM)."""
    found = sorted(GENERATION_ARGUMENTS & kwargs.keys())
    if not found:
        return
    given = ", ".join(f"{name}={kwargs[name]!r:.40}" for name in found)
    call, instead = ("tracer.invoke()", f"with model.generate() as tracer: with tracer.invoke(prompt, {given}):")
    if not invoke:
        call, instead = "trace()", f"with model.generate(prompt, {given}) as tracer:"
    raise TypeError(
        f"{call} got generation argument(s) {given}: a trace runs one forward pass, so they would not apply. "
        f"To generate, open the block with generate, which takes them (`{instead}`), and act at each step with "
        "`for step in tracer.iter[:n]:` (or `tracer.all()`)"
    )


# -- traces and invokes that never run ----------------------------------------------------------------------

#: Where the library's own frames and nnsight's live: a site is the first frame outside them.
_LIBRARY_DIRECTORIES = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep for path in (nnsight.__file__, os.path.dirname(__file__))
)
#: The lines a `TraceNeverRan` warning was given for (once per line).
_WARNED_SITES: set[tuple[str, int]] = set()


def caller_site() -> tuple[str, int]:
    """``(file, line)`` of the caller's code that led here: the first frame outside this library and nnsight."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRECTORIES):
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno


class WarnsIfNeverRun:
    """A tracer or invoke mixin: discarded without having run, it warns `TraceNeverRan` once per line that built
    one, naming that line (a ``model.trace(...)`` written without ``with`` returns a tracer and runs nothing).

    A copy unpickled elsewhere (in an engine's worker, on a remote backend) is not the caller's and never warns.
    """

    _site: tuple[str, int] | None = None
    _ran = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._site = caller_site()

    def __exit__(self, *exception: Any) -> bool:
        self._ran = True
        return super().__exit__(*exception)  # type: ignore[misc]

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        self._site = None

    def _never_ran(self) -> str | None:
        """What to say, discarded without having run; ``None``: nothing (it was never meant to run)."""
        raise NotImplementedError

    def __del__(self) -> None:
        site = self._site
        if self._ran or site is None or site in _WARNED_SITES:
            return
        said = self._never_ran()
        if said is None:
            return
        _WARNED_SITES.add(site)
        warnings.warn_explicit(f"{said} (at {site[0]}:{site[1]})", TraceNeverRan, *site)


class Invoke(WarnsIfNeverRun, Invoker):
    """nnsight's invoke; never entered, it warns: its prompt was left out of the batch."""

    def _never_ran(self) -> str:
        return (
            "tracer.invoke(...) was never entered, so its prompt was left out of the trace: write "
            "`with tracer.invoke(prompt):` with that prompt's reads and writes in its body"
        )


class OneAtATime(WarnsIfNeverRun):
    """A tracer mixin: a model runs one trace at a time; a trace from another thread waits for the running one.

    A model's interleaver (its workers, its batch) is one per model, so two traces running at once
    from two threads would share it and break each other. The containers of saved values the trace
    body bound beside its invokes are handed back too (`saving`). A trace opened in another trace's
    body is refused as it is made (``ValueError``), and ``.stop()`` on a value says what stops a pass.
    A trace (`one_step`, set by the engine's ``trace``) refuses generation arguments in its invokes, and warns
    if it is discarded without having run; a generation warns only if its ``with`` line was found and the
    block never ran (called without ``with``, ``generate`` just generates).
    """

    envoy: Any
    #: Whether this tracer is one forward pass (a ``trace``), not a generation.
    one_step = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if in_a_trace_body():
            raise ValueError(NESTED_TRACE)
        super().__init__(*args, **kwargs)

    def invoke(self, *args: Any, **kwargs: Any) -> Invoke:
        """nnsight's invoke; in a trace, generation arguments are refused (``TypeError``), as by the trace."""
        if self.one_step:
            refuse_generation_arguments(kwargs, invoke=True)
        return Invoke(self, *args, **kwargs)

    def _never_ran(self) -> str | None:
        if self.one_step:
            return (
                "model.trace(...) never ran, so nothing was traced: a trace runs when the `with` block it opens "
                "ends. Write `with model.trace(...):` with the reads and writes in its body"
            )
        if getattr(self, "info", None) is not None:
            return "model.generate(...) was built as a `with` block that never ran, so nothing was generated"
        return None

    def execute(self, code: CodeType) -> None:
        frame = self.info.frame  # type: ignore[attr-defined]
        # The scope the trace body's own bindings land in (one object until the trace ends).
        shared = shared_locals(frame)
        try:
            with model_lock(self.envoy):
                super().execute(code)  # type: ignore[misc]
        except AttributeError as error:
            clearer = clearer_stop_error(error)
            if clearer is error:
                raise
            raise clearer from None
        push_result(frame, hand_back_shared(shared))


def one_forward_pass(tracer: Any) -> Any:
    """``tracer`` (what an engine's ``trace`` built) marked as one forward pass (`OneAtATime.one_step`)."""
    if isinstance(tracer, OneAtATime):
        tracer.one_step = True
    return tracer


class Tracer(OneAtATime, InterleavingTracer):
    """nnsight's tracer for a local model, one trace at a time per model."""


# -- writes to parameters ---------------------------------------------------------------------------------------

#: The name under which a trace body's `ParameterReads` sits in its scope, saved: on vLLM it travels back
#: from the engine's worker with the body's saved values.
PARAMETER_READS = "__nnterp_vllm_parameter_reads__"
#: The parameters each model has warned about (once per parameter).
_WARNED_PARAMETERS: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def spelled(envoy: Any, name: str) -> str:
    """How the caller reaches attribute ``name`` of ``envoy`` from the model: ``model.model.layers[0].mlp.weight``."""
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", f"{envoy.path}.{name}")


class ParameterReads:
    """The parameters one trace body reached by name, each with its version (PyTorch's count of in-place writes)
    when first reached: the ones whose version moved were written. Reaching one costs a dict entry; a trace that
    reaches none pays nothing.

    Pickled (to travel from vLLM's worker once the body has run), it carries only the names of those written.
    """

    def __init__(self, written: Iterable[str] = ()) -> None:
        self.reached: dict[int, tuple[str, torch.Tensor, int]] = {}
        self.arrived = tuple(written)

    def reach(self, name: str, parameter: torch.Tensor) -> None:
        self.reached.setdefault(id(parameter), (name, parameter, parameter._version))

    def written(self) -> list[str]:
        moved = [name for name, parameter, version in self.reached.values() if parameter._version != version]
        return [*self.arrived, *moved]

    def __reduce__(self) -> tuple:
        return ParameterReads, (tuple(self.written()),)


def _reached(envoy: Any, name: str, parameter: torch.Tensor) -> None:
    """Note, in the running trace body's scope, that it reached ``parameter`` as ``name`` of ``envoy``."""
    worker = getattr(getcurrent(), "mediator", None)
    mediator = worker() if worker is not None else None
    if mediator is None or not isinstance(envoy.root, Standardized):
        return
    scope = mediator.lcls
    reads = dict.get(scope, PARAMETER_READS)
    if reads is None:
        reads = ParameterReads()
        # Not a binding of the body's (so it is not pushed into the caller's variables); saved, so that on
        # vLLM it comes back with the request's saved values.
        dict.__setitem__(scope, PARAMETER_READS, mark(reads))
    reads.reach(spelled(envoy, name), parameter)


def warn_parameters_written(model: Any, reads: Iterable[Any]) -> None:
    """Warn `ParameterWritten`, once per parameter of ``model``, for each parameter the `ParameterReads` written."""
    warned = _WARNED_PARAMETERS.setdefault(model, set())
    for found in reads:
        for name in found.written() if isinstance(found, ParameterReads) else ():
            if name in warned:
                continue
            warned.add(name)
            warnings.warn_explicit(
                f"{name} was written in a trace: that changes the model's weights themselves, so the change stays "
                "for every later trace and generation of this model. To undo it, keep a copy before the write "
                f"(`original = {name}.clone().save()` in a trace) and write it back after (`{name}[:] = original` "
                "in a later trace), or load the model again. For a change that lasts one trace, write a module's "
                "output instead (e.g. `model.layers[i].mlp_output`); for one you can undo, install it with "
                "`model.edit()` and undo it with `model.clear_edits()`",
                ParameterWritten,
                *caller_site(),
            )


def warn_mediators_wrote_parameters(model: Any, mediators: Iterable[Any]) -> None:
    """`warn_parameters_written` for the trace bodies that ran in this process (transformers)."""
    warn_parameters_written(model, (dict.get(mediator.lcls, PARAMETER_READS) for mediator in mediators))


_envoy_getattr = Envoy.__getattr__
_envoy_setattr = Envoy.__setattr__


def _getattr_noting_parameters(self: Envoy, name: str) -> Any:
    value = _envoy_getattr(self, name)
    if isinstance(value, torch.nn.Parameter):
        _reached(self, name, value)
    return value


def _setattr_refusing_parameters(self: Envoy, name: str, value: Any) -> None:
    module = self.__dict__.get("_module")
    parameter = getattr(module, "_parameters", {}).get(name) if module is not None else None
    if parameter is None or not isinstance(self.root, Standardized):
        _envoy_setattr(self, name, value)
        return
    if value is parameter:  # `weight *= 2`: written in place already; binding it on the envoy would shadow it
        return
    where = spelled(self, name)
    raise TypeError(
        f"{where} = ... does not change the model: nnsight would bind the name on its envoy, and the module would "
        f"go on computing with its own parameter. To change the weight itself (for good: every later trace and "
        f"generation of this model sees it), write into it: `{where}[:] = value`; for a change that lasts one "
        "trace, write the module's output instead"
    )


# Every module the model reaches by name has an envoy, most of them nnsight's plain `Envoy` (no family names a
# Linear), so a parameter reached by name goes through `Envoy`'s own attribute fallback and nowhere else; both
# act only on the trees of standardized models.
Envoy.__getattr__ = _getattr_noting_parameters
Envoy.__setattr__ = _setattr_refusing_parameters
