"""Mistakes nnsight lets pass without a word, made loud the same way on both engines.

Generation arguments given to a trace (one forward pass) are refused before anything runs; a trace or invoke
built and never run warns when it is discarded, naming its line; a write to a model parameter in a trace warns
once per parameter that it stays. Each is checked on StandardizedTransformer and StandardizedVLLM over one tiny
checkpoint (the vLLM engine built once for the module).
"""

from __future__ import annotations

import contextlib
import inspect
import re
import warnings

import pytest
import tiny
import torch
from reference import OTHER_PROMPT, PROMPT

from nnterp_vllm import StandardizedTransformer, StandardizedVLLM
from nnterp_vllm.engines import tracing
from nnterp_vllm.engines.tracing import GENERATION_ARGUMENTS
from nnterp_vllm.errors import ParameterWritten, TraceNeverRan

ENGINES = ("transformers", "vllm")
#: Generation arguments of either engine, each refused by a trace on both.
REFUSED = {
    "max_new_tokens": 5,
    "min_new_tokens": 2,
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 5,
    "num_beams": 2,
    "max_tokens": 5,
    "min_tokens": 2,
    "ignore_eos": True,
    "seed": 0,
    "n": 2,
}


@pytest.fixture(scope="module")
def built():
    path = tiny.checkpoint("llama")
    models = {"transformers": StandardizedTransformer(path), "vllm": StandardizedVLLM(path, dtype="float32")}
    yield models
    models["vllm"].shutdown()


@pytest.fixture(params=ENGINES)
def model(request, built):
    return built[request.param]


@pytest.fixture(autouse=True)
def lines_not_yet_warned_about(monkeypatch):
    """Each test starts with no line warned about yet (a line warns once per process; tests on both engines
    share their lines)."""
    monkeypatch.setattr(tracing, "_WARNED_SITES", set())


def line_of(code: str) -> int:
    """The line of this file holding ``code`` (once)."""
    (number,) = [i for i, line in enumerate(open(__file__).read().splitlines(), 1) if line.strip() == code]
    return number


def traced_logits(model):
    with model.trace(PROMPT):
        logits = model.logits.save()
    return logits


def warnings_of(kind, caught):
    return [warning for warning in caught if issubclass(warning.category, kind)]


# -- generation arguments --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", REFUSED)
def test_a_trace_refuses_each_generation_argument_before_it_is_built(model, name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TypeError, match=rf"trace\(\) got generation argument\(s\) {name}=.*model\.generate\("):
            model.trace(PROMPT, **{name: REFUSED[name]})  # refused at the call: no tracer exists to run
    assert not warnings_of(TraceNeverRan, caught)


def test_the_refusal_names_every_argument_and_how_to_act_at_each_step(model):
    with pytest.raises(TypeError) as caught:
        with model.trace(PROMPT, max_new_tokens=5, temperature=0.5):
            model.logits.save()
    message = str(caught.value)
    assert "max_new_tokens=5, temperature=0.5" in message and "one forward pass" in message
    assert "with model.generate(prompt, max_new_tokens=5, temperature=0.5) as tracer:" in message
    assert "tracer.iter[:n]" in message
    assert torch.isfinite(traced_logits(model)).all()  # the model serves on


def test_an_invoke_of_a_trace_refuses_generation_arguments(model):
    with pytest.raises(TypeError, match=r"tracer\.invoke\(\) got generation argument\(s\) max_new_tokens=3"):
        with model.trace() as tracer:
            with tracer.invoke(PROMPT, max_new_tokens=3):
                model.logits.save()
    assert torch.isfinite(traced_logits(model)).all()


def test_generate_keeps_taking_them(model):
    steps = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": False}
    with model.generate(PROMPT, **steps) as tracer:
        result = tracer.result.save()
    prompt_length = len(model.tokenizer(PROMPT)["input_ids"])
    made = result.shape[-1] - prompt_length if model.ENGINE == "transformers" else len(result.outputs[0].token_ids)
    assert made == 3


def test_generate_in_invoke_mode_takes_them_per_invoke_on_vllm(built):
    model = built["vllm"]
    with model.generate(max_tokens=2) as tracer:
        with tracer.invoke(PROMPT, max_tokens=4, ignore_eos=True):
            longer = tracer.result.save()
        with tracer.invoke(OTHER_PROMPT, ignore_eos=True):
            default = tracer.result.save()
    assert [len(output.outputs[0].token_ids) for output in (longer, default)] == [4, 2]


def test_a_trace_keeps_taking_forward_arguments(built):
    model = built["transformers"]
    with model.trace(PROMPT, use_cache=False, output_attentions=False):
        logits = model.logits.save()
    torch.testing.assert_close(logits, traced_logits(model))


def test_the_refused_set_holds_what_either_engine_generates_with():
    from transformers import GenerationConfig, GenerationMixin
    from vllm import SamplingParams

    # What a forward pass takes too, and the tokenizer's truncation length, stay a trace's to take.
    forward = {"use_cache", "output_attentions", "output_hidden_states", "max_length"}
    generate = set(inspect.signature(GenerationMixin.generate).parameters) - {"self", "inputs", "kwargs"}
    transformers = {name for name in GenerationConfig().to_dict() if not name.startswith("_")}
    transformers.discard("transformers_version")
    sampling = {name for name in SamplingParams.__struct_fields__ if not name.startswith("_")}
    assert (transformers | generate) - forward <= GENERATION_ARGUMENTS
    assert sampling <= GENERATION_ARGUMENTS
    assert not forward & GENERATION_ARGUMENTS


# -- traces and invokes that never run --------------------------------------------------------------------------


def test_a_trace_never_entered_warns_naming_the_line_that_built_it(model):
    with pytest.warns(TraceNeverRan) as caught:
        model.trace(PROMPT)  # built, never entered
    (warning,) = warnings_of(TraceNeverRan, caught)
    line = line_of("model.trace(PROMPT)  # built, never entered")
    assert (warning.filename, warning.lineno) == (__file__, line)
    assert f"{__file__}:{line}" in str(warning.message)
    assert "model.trace(...) never ran" in str(warning.message) and "with model.trace(...):" in str(warning.message)


def test_a_trace_kept_in_a_name_warns_when_the_name_goes(model):
    def build():
        tracer = model.trace(PROMPT)  # kept, never entered
        return tracer

    tracer = build()
    with pytest.warns(TraceNeverRan, match=r"model\.trace\(\.\.\.\) never ran") as caught:
        del tracer
    (warning,) = warnings_of(TraceNeverRan, caught)
    assert warning.lineno == line_of("tracer = model.trace(PROMPT)  # kept, never entered")


def test_it_warns_once_per_line(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model.trace(PROMPT)  # three times, one warning
    assert len(warnings_of(TraceNeverRan, caught)) == 1


def test_an_invoke_never_entered_warns_that_its_prompt_was_left_out(model):
    with pytest.warns(TraceNeverRan, match=r"tracer\.invoke\(\.\.\.\) was never entered") as caught:
        with model.trace() as tracer:
            tracer.invoke(OTHER_PROMPT)  # never entered
            with tracer.invoke(PROMPT):
                logits = model.logits.save()
    (warning,) = warnings_of(TraceNeverRan, caught)
    assert warning.lineno == line_of("tracer.invoke(OTHER_PROMPT)  # never entered")
    assert logits.shape[0] == 1  # only the entered invoke ran


def test_a_generation_whose_with_block_never_runs_warns(model):
    with pytest.warns(TraceNeverRan, match=r"model\.generate\(\.\.\.\) was built as a `with` block that never ran"):
        with contextlib.nullcontext(model.generate(PROMPT, max_new_tokens=2)):  # the tracer is not entered
            pass


def test_what_runs_does_not_warn(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced_logits(model)
        with model.generate(PROMPT, max_new_tokens=2):
            model.logits.save()
        model.generate(PROMPT, max_new_tokens=2)  # without `with`, generate just generates
        with model.trace() as tracer:
            with tracer.invoke(PROMPT):
                model.logits.save()
        model.logit_lens(PROMPT)
    assert not warnings_of(TraceNeverRan, caught)


def test_a_trace_whose_body_raises_does_not_warn(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="steer"):
            with model.trace(PROMPT):
                model.steer(layers=model.num_layers, vector=torch.ones(model.hidden_size))
    assert not warnings_of(TraceNeverRan, caught)


# -- writes to parameters ---------------------------------------------------------------------------------------


def test_a_parameter_written_in_a_trace_warns_once_stays_and_can_be_put_back(model):
    name = "model.model.layers[0].input_layernorm.weight"
    with torch.no_grad(), pytest.warns(ParameterWritten) as caught:
        with model.trace(PROMPT):
            original = model.layers[0].input_layernorm.weight.clone().save()
            model.layers[0].input_layernorm.weight[:] = 0  # through the standardized name
    (warning,) = warnings_of(ParameterWritten, caught)
    message = str(warning.message)
    assert message.startswith(f"{name} was written in a trace") and "every later trace and generation" in message
    assert f"original = {name}.clone().save()" in message and f"`{name}[:] = original`" in message
    assert "model.edit()" in message and "model.clear_edits()" in message
    assert warning.filename == __file__

    with torch.no_grad(), warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        with model.trace(PROMPT):
            now = model.layers[0].input_layernorm.weight.clone().save()
            model.layers[0].input_layernorm.weight[:] = original  # the undo: a second write, no second warning
        with model.trace(PROMPT):
            restored = model.layers[0].input_layernorm.weight.clone().save()
    assert torch.count_nonzero(now) == 0  # the write stayed for the next trace
    torch.testing.assert_close(restored, original)
    assert not warnings_of(ParameterWritten, again)


def test_an_in_place_write_through_the_native_name_warns_for_that_parameter(model):
    with torch.no_grad(), pytest.warns(ParameterWritten, match=r"^model\.model\.layers\[1\]\.post_attention_layernorm"):
        with model.trace(PROMPT):
            model.model.layers[1].post_attention_layernorm.weight *= 1.0


def test_reading_a_parameter_does_not_warn(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with model.trace(PROMPT):
            norm = model.layers[2].input_layernorm.weight.sum().save()
            logits = model.logits.save()
    assert torch.isfinite(norm) and torch.isfinite(logits).all()
    assert not warnings_of(ParameterWritten, caught)


def test_assigning_a_parameter_through_the_model_is_refused(model):
    name = "model.model.layers[0].mlp.down_proj.weight"
    with pytest.raises(TypeError, match=rf"^{re.escape(name)} = \.\.\. does not change the model"):
        with model.trace(PROMPT):
            model.layers[0].mlp.down_proj.weight = torch.zeros(3)
    assert "weight" not in vars(model.layers[0].mlp.down_proj)  # not bound on the envoy either
    assert torch.isfinite(traced_logits(model)).all()


def test_assigning_a_parameter_outside_a_trace_is_refused_too(built):
    model = built["transformers"]
    with pytest.raises(TypeError, match=r"write into it: `model\.lm_head\.weight\[:\] = value`"):
        model.lm_head.weight = torch.nn.Parameter(torch.zeros(model.vocab_size, model.hidden_size))


def test_the_library_methods_write_no_parameter(model):
    vector = torch.ones(model.hidden_size)
    before = traced_logits(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), model.trace(PROMPT):
            model.steer(layers=0, vector=vector, factor=3.0)
            model.skip_layers(1)
            projected = model.project_on_vocab(model.layers[2].layer_output).save()
        model.logit_lens(PROMPT)
        model.get_topk_closest_tokens(vector, k=2)
    assert torch.isfinite(projected).all()
    assert not warnings_of(ParameterWritten, caught)
    torch.testing.assert_close(traced_logits(model), before)
