"""Bad input never kills the engine: every case gets a clear error before any work, on both engines.

Each case is what a hostile-but-realistic user writes. The test asserts the error's class, that its
message names what was wrong and what would be right, and, on vLLM, that the engine serves the next
request (the same trace, written correctly).
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import reference
import tiny
import torch

from nnterp_vllm import EngineShutDown, StandardizedTransformer, StandardizedVLLM, UnavailableValue
from nnterp_vllm.engines import engine_defaults

PROMPT = reference.PROMPT
TOKENS = len(tiny.tokenizer()(PROMPT)["input_ids"])
HIDDEN = tiny.SIZES["hidden_size"]


@pytest.fixture(scope="module", params=["transformers", "vllm"])
def model(request):
    path = tiny.checkpoint("llama")
    if request.param == "transformers":
        yield StandardizedTransformer(path)
        return
    on_vllm = StandardizedVLLM(path, dtype="float32")
    yield on_vllm
    on_vllm.shutdown()


def serves_the_next_trace(model):
    with model.trace(PROMPT):
        logits = model.logits.save()
    assert logits.shape == (1, TOKENS, model.vocab_size) and torch.isfinite(logits).all()


def refused_in_a_trace(model, body, kind, *words, prompt=PROMPT):
    with pytest.raises(kind) as caught:
        with model.trace(prompt):
            body()
            model.logits.save()
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))
    serves_the_next_trace(model)


# -- writes of the wrong shape ------------------------------------------------------------------

WRONG_WRITES = [
    ("layer_output", (1, TOKENS - 1, HIDDEN)),
    ("layer_output", (1, TOKENS - 6, HIDDEN)),
    ("layer_output", (1, TOKENS - 8, HIDDEN)),
    ("layer_output", (1, TOKENS + 3, HIDDEN)),
    ("layer_output", (2, TOKENS, HIDDEN)),
    ("layer_output", (1, TOKENS, HIDDEN + 1)),
    ("mlp_output", (1, TOKENS - 3, HIDDEN)),
    ("layer_input", (1, TOKENS - 3, HIDDEN)),
    ("attention_output", (1, TOKENS + 2, HIDDEN)),
]


@pytest.mark.parametrize("name, shape", WRONG_WRITES)
def test_a_write_of_the_wrong_shape_is_refused_and_the_engine_serves_on(model, name, shape):
    def write():
        setattr(model.layers[1], name, torch.zeros(shape))

    expected = f"[1, {TOKENS}, {HIDDEN}]"
    refused_in_a_trace(model, write, ValueError, name, str(list(shape)), expected)


def test_a_write_that_is_no_tensor_or_does_not_cast_is_refused(model):
    refused_in_a_trace(model, lambda: setattr(model.layers[1], "layer_output", 0.5), ValueError, "write a tensor")
    complex_stream = torch.zeros(1, TOKENS, HIDDEN, dtype=torch.complex64)
    refused_in_a_trace(
        model, lambda: setattr(model.layers[1], "layer_output", complex_stream), ValueError, "cannot be written"
    )


def test_an_integer_write_is_cast_to_the_value_dtype(model):
    with model.trace(PROMPT):
        model.layers[1].mlp_output = torch.zeros(1, TOKENS, HIDDEN, dtype=torch.int64)
        written = model.layers[1].mlp_output.save()
    assert written.dtype == torch.float32 and not written.any()


def test_a_logits_write_of_the_wrong_width_is_refused(model):
    if model.ENGINE != "vllm":
        pytest.skip("logits are written on vLLM only (they are what it samples from)")
    refused_in_a_trace(
        model, lambda: setattr(model, "logits", torch.zeros(1, TOKENS, 7)), ValueError, "[1, 7]", "logits"
    )


# -- method arguments -----------------------------------------------------------------------------

STEER_CASES = [
    ({"vector": torch.zeros(3, HIDDEN), "positions": [0, 1]}, "3 rows for 2 positions"),
    ({"vector": torch.zeros(HIDDEN), "positions": 100}, "position(s) [100] are outside"),
    ({"vector": torch.zeros(HIDDEN), "positions": -100}, "position(s) [-100] are outside"),
    ({"vector": torch.zeros(HIDDEN), "positions": [0, 100]}, "position(s) [100] are outside"),
    ({"vector": torch.zeros(HIDDEN), "positions": 1.5}, "positions must be None, an int"),
    ({"vector": torch.zeros(HIDDEN), "positions": slice(100, None)}, "reaches past the sequence"),
    ({"vector": torch.zeros(HIDDEN), "positions": slice(3, 3)}, "selects no position"),
    ({"vector": torch.zeros(HIDDEN), "positions": slice(0.5, 2)}, "a slice of positions takes ints"),
    ({"vector": torch.zeros(HIDDEN), "factor": "2"}, "factor must be a finite number"),
    ({"vector": torch.zeros(7)}, f"[hidden_size] = [{HIDDEN}]"),
]


@pytest.mark.parametrize("kwargs, message", STEER_CASES)
def test_steer_refuses_bad_arguments_with_the_fix(model, kwargs, message):
    refused_in_a_trace(model, lambda: model.steer(layers=1, **kwargs), ValueError, "steer", message)


def test_logit_lens_refuses_a_position_past_the_prompt(model):
    with pytest.raises(ValueError, match=r"logit_lens: position\(s\) \[100\] are outside"):
        model.logit_lens(PROMPT, position=100)
    serves_the_next_trace(model)


def test_layers_take_ints_or_slices(model):
    refused_in_a_trace(model, lambda: model.layers[1.5].layer_output.save(), TypeError, "int or a slice", "1.5")
    refused_in_a_trace(model, lambda: model.layers[99].layer_output.save(), IndexError, "num_layers=3")


# -- prompts ----------------------------------------------------------------------------------------

BAD_PROMPTS = [
    (123, TypeError, "of type int (123); give a string, a list of token ids"),
    (None, TypeError, "of type NoneType"),
    ([1.5, 2.5], TypeError, "list of float items"),
    (["a", 3], TypeError, "list of int/str items"),
    ([], ValueError, "empty list"),
    ([5, 99999], ValueError, "token id(s) [99999] are outside the vocabulary"),
    (torch.tensor([1.0, 2.0]), TypeError, "integer tensor"),
    ("", ValueError, "empty string"),
]


@pytest.mark.parametrize("prompt, kind, message", BAD_PROMPTS, ids=[repr(case[0])[:20] for case in BAD_PROMPTS])
def test_a_prompt_that_is_no_text_or_token_ids_is_refused(model, prompt, kind, message):
    with pytest.raises(kind) as caught:
        with model.trace(prompt):
            model.logits.save()
    assert message in str(caught.value)
    serves_the_next_trace(model)


def test_a_bare_token_id_is_no_prompt_on_vllm_either(model):
    with pytest.raises(TypeError, match="of type int"):
        with model.trace() as tracer:
            with tracer.invoke(5):
                model.logits.save()
    serves_the_next_trace(model)


def test_a_prompt_longer_than_the_model_takes_is_refused(model):
    too_long = [5] * (tiny.SIZES["max_position_embeddings"] + 10)
    with pytest.raises(ValueError) as caught:
        with model.trace(too_long):
            model.logits.save()
    assert "266" in str(caught.value) and "256" in str(caught.value), str(caught.value)
    serves_the_next_trace(model)


# -- outside a trace ----------------------------------------------------------------------------------

OUTSIDE = {
    "steer": lambda model: model.steer(1, torch.zeros(HIDDEN)),
    "skip_layers": lambda model: model.skip_layers(1),
    "layer_output": lambda model: model.layers[1].layer_output,
    "attention_queries": lambda model: model.layers[1].self_attn.attention_queries,
    "logits": lambda model: model.logits,
    "next_token_probs": lambda model: model.next_token_probs,
}


@pytest.mark.parametrize("name", OUTSIDE)
def test_methods_and_values_outside_a_trace_say_so(model, name):
    with pytest.raises(ValueError, match=rf"{name}.*only served inside a trace.*with model.trace"):
        OUTSIDE[name](model)


def test_a_write_outside_a_trace_says_so(model):
    with pytest.raises(ValueError, match="layer_output is only served inside a trace"):
        model.layers[1].layer_output = torch.zeros(1, TOKENS, HIDDEN)


def test_an_unavailable_value_is_refused_with_its_reason(model):
    refused_in_a_trace(model, lambda: model.layers[0].mlp.router_logits.save(), UnavailableValue, "dense")


# -- threads ------------------------------------------------------------------------------------------


def test_two_threads_tracing_one_model_are_served_one_after_the_other(model):
    prompts = [PROMPT, reference.OTHER_PROMPT, "Paris is the capital of", "One two three"]
    expected = {}
    for prompt in prompts:
        with model.trace(prompt):
            expected[prompt] = model.layers[2].layer_output.save()
    results, errors = {}, []

    def work(prompt):
        try:
            for _ in range(2):
                with model.trace(prompt):
                    value = model.layers[2].layer_output.save()
                results.setdefault(prompt, []).append(value)
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(prompt,)) for prompt in prompts * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert sorted(results) == sorted(prompts)
    for prompt, values in results.items():
        assert len(values) == 4
        for value in values:
            torch.testing.assert_close(value, expected[prompt], atol=1e-6, rtol=1e-6)


# -- loading --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", [StandardizedTransformer, StandardizedVLLM])
def test_a_checkpoint_without_or_with_a_broken_config_is_named(engine, tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        engine(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON.*save the model again"):
        engine(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        engine(tmp_path / "missing")


def test_the_cpu_kv_cache_fits_the_context_and_caps_it_with_one_log_line(monkeypatch, caplog):
    small = SimpleNamespace(available=2**30)
    monkeypatch.setattr("psutil.virtual_memory", lambda: small)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    path = tiny.checkpoint("llama")
    per_token = 2 * 3 * 2 * 32 * 4  # keys and values, 3 layers, 2 key/value heads of 32, fp32
    fitted = engine_defaults.engine_kwargs(str(path), dtype="float32")
    assert fitted["kv_cache_memory_bytes"] == engine_defaults.CPU_KV_CACHE_BYTES  # 4 x 256 tokens is tiny
    assert "max_model_len" not in fitted
    long_context = tiny.checkpoint("llama", max_position_embeddings=2**20)
    with caplog.at_level(logging.WARNING, logger=engine_defaults.__name__):
        capped = engine_defaults.engine_kwargs(str(long_context), dtype="float32")
    budget = 2**30 // 4
    assert capped["kv_cache_memory_bytes"] == budget
    assert capped["max_model_len"] == budget // per_token // 128 * 128
    [line] = [record.getMessage() for record in caplog.records]
    assert f"max_model_len lowered from {2**20}" in line and "max_model_len=" in line
    explicit = engine_defaults.engine_kwargs(str(long_context), dtype="float32", max_model_len=2**15)
    assert explicit["max_model_len"] == 2**15 and explicit["kv_cache_memory_bytes"] == 4 * 2**15 * per_token
    beyond = engine_defaults.engine_kwargs(str(long_context), dtype="float32", max_model_len=2**19)
    assert beyond["max_model_len"] == 2**19 and beyond["kv_cache_memory_bytes"] == budget  # vLLM says it is short
    # A sized cache is the caller's; the dtype is the one the library loads the checkpoint in (its config's).
    sized = engine_defaults.engine_kwargs(str(path), kv_cache_memory_bytes=7)
    assert sized == {"kv_cache_memory_bytes": 7, "dtype": "float32"}


def test_a_steered_engine_sizes_the_cpu_kv_cache_for_its_checkpoint_as_the_others_do(monkeypatch):
    """`SteeredVLLM` (and the harvest's in-engine path, built on it) sizes the KV cache for the checkpoint's
    context, lowering ``max_model_len`` where a full-length sequence does not fit, as `StandardizedVLLM` does."""
    from nnterp_vllm.engines.steered.steered_settings import steering_settings

    monkeypatch.setattr("psutil.virtual_memory", lambda: SimpleNamespace(available=2**30))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    long_context = str(tiny.checkpoint("llama", max_position_embeddings=2**20))
    expected = engine_defaults.engine_kwargs(long_context, dtype="float32")
    settings = steering_settings(long_context, {"dtype": "float32"})
    assert settings["max_model_len"] == expected["max_model_len"] < 2**20
    assert settings["kv_cache_memory_bytes"] == expected["kv_cache_memory_bytes"] == 2**30 // 4
    chosen = steering_settings(long_context, {"dtype": "float32", "max_model_len": 4096})
    assert "max_model_len" not in chosen  # the caller's stays as given
    assert (
        chosen["kv_cache_memory_bytes"]
        == engine_defaults.engine_kwargs(long_context, dtype="float32", max_model_len=4096)["kv_cache_memory_bytes"]
    )


# -- what would kill the engine -------------------------------------------------------------------------


def test_a_trace_inside_a_trace_is_refused_and_the_model_serves_on(model):
    with pytest.raises(ValueError) as caught:
        with model.trace(PROMPT):
            model.layers[0].layer_output.save()
            with model.trace(reference.OTHER_PROMPT):
                model.layers[0].layer_output.save()
    assert "a trace cannot be opened inside a running trace" in str(caught.value)
    assert "tracer.invoke(prompt)" in str(caught.value)
    serves_the_next_trace(model)


def test_stop_on_a_value_says_how_a_pass_ends_early_and_the_tracers_stop_does(model):
    with pytest.raises(AttributeError) as caught:
        with model.trace(PROMPT):
            model.layers[1].output.stop()
    assert "a value has no .stop()" in str(caught.value) and "tracer.stop()" in str(caught.value)
    serves_the_next_trace(model)
    with model.trace(PROMPT) as tracer:
        stream = model.layers[1].layer_output.save()
        tracer.stop()
    assert stream.shape == (1, TOKENS, HIDDEN)
    serves_the_next_trace(model)


def test_a_vector_on_the_meta_device_is_refused_naming_the_device(model):
    meta = torch.zeros(HIDDEN, device="meta")
    refused_in_a_trace(model, lambda: model.steer(layers=1, vector=meta), ValueError, "meta device", "on the CPU")


def test_a_stream_written_non_finite_changes_no_later_trace(model):
    """What one trace writes stays in its own output: on vLLM the NaN a non-finite stream leaves in its KV-cache
    blocks used to reach the next traces given those blocks."""
    with model.trace(PROMPT):
        before = model.logits.save()
    longer = PROMPT + " and then a good many more words"
    length = len(tiny.tokenizer()(longer)["input_ids"])
    with model.trace(longer):
        model.layers[1].layer_output = torch.full((1, length, HIDDEN), float("inf"))
        poisoned = model.logits.save()
    assert not torch.isfinite(poisoned).all()
    for _ in range(3):
        with model.trace(PROMPT):
            after = model.logits.save()
        torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_after_shutdown_every_trace_says_the_engine_was_shut_down(model):
    """Runs last in the module: it shuts the vLLM engine down (the fixture's shutdown is idempotent)."""
    if model.ENGINE != "vllm":
        pytest.skip("transformers has no engine to shut down")
    model.shutdown()
    model.shutdown()
    for use in (lambda: model.trace(PROMPT), lambda: model.generate(PROMPT, max_new_tokens=2)):
        with pytest.raises(EngineShutDown, match=r"StandardizedVLLM: this engine was stopped by shutdown\(\)"):
            use()
    with pytest.raises(EngineShutDown, match="build a new StandardizedVLLM"):
        model.get_topk_closest_tokens(torch.ones(HIDDEN), k=2)
    assert model.num_layers == 3 and model.support()["layer_output"] is None  # what needs no engine still answers
