"""One steered request changes only its own output, at every dtype vLLM's CPU build runs (SteeredVLLM).

A vector whose added value a model's dtype cannot hold (every number finite: ``[3e38] * hidden`` times
10) used to turn the stream non-finite; the NaN it left in freed KV-cache blocks then turned the output
of later requests, whoever sent them, into ''. Now such steering is refused before the engine, naming a
bound derived from the dtype; and a request whose stream still turns non-finite inside the engine (here
sent past the client's check, straight to vLLM's own ``LLM.generate``) leaves every later and concurrent
request answering as a fresh engine does, token for token. The engine's KV cache is a few blocks, so the
requests after the poisoned one reuse its blocks.
"""

from __future__ import annotations

import math

import pytest
import tiny
import torch
from vllm import LLM, SamplingParams

from nnterp_vllm import EngineShutDown, SteeredVLLM, Steering
from nnterp_vllm.specs.steering_requests import EXTRA_ARGS_KEY, request_steering

HIDDEN = tiny.SIZES["hidden_size"]
LAYERS = tiny.SIZES["num_hidden_layers"]
BLOCK = 32
BLOCKS = 24
STEPS = 12
GREEDY = {"temperature": 0.0, "max_tokens": STEPS, "ignore_eos": True, "logprobs": 0}
POISON = "Tell me a story about a dragon who lives in the mountains"
#: The largest value each dtype holds, over the engine's headroom of 16.
BOUNDS = {"float32": "+-2.13e+37", "bfloat16": "+-2.12e+37", "float16": "+-4.09e+03"}


def prompts() -> list[str]:
    """32 short prompts: each (with its generated tokens) fills part of one block, and together they take every
    block of the cache, the poisoned request's too, whose slots past their own hold what it left there."""
    return [f"Q{i} is" for i in range(32)]


def steering(hidden_size: int) -> list[list[Steering] | None]:
    vector = torch.randn(hidden_size, generator=torch.Generator().manual_seed(3))
    return [[Steering(i % LAYERS, vector, factor=2.0)] if i % 2 else None for i in range(32)]


#: bfloat16 holds float32's range: its run is left to the slow suite.
@pytest.fixture(scope="module", params=["float32", "float16", pytest.param("bfloat16", marks=pytest.mark.slow)])
def engine(request):
    per_token = 2 * LAYERS * tiny.SIZES["num_key_value_heads"] * 32 * getattr(torch, request.param).itemsize
    llm = SteeredVLLM(
        tiny.checkpoint("llama"),
        dtype=request.param,
        max_model_len=128,
        block_size=BLOCK,
        kv_cache_memory_bytes=BLOCKS * BLOCK * per_token,
    )
    reference = tokens(llm.generate(prompts(), SamplingParams(**GREEDY), steering(llm.hidden_size), use_tqdm=False))
    yield llm, request.param, reference
    llm.shutdown()


def tokens(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_steering_the_dtype_cannot_hold_is_refused_naming_the_bound(engine):
    llm, dtype, reference = engine
    requests = llm.request_counter.counter
    with pytest.raises(ValueError) as refused:
        llm.generate(POISON, SamplingParams(**GREEDY), Steering(1, [3e38] * HIDDEN, factor=10))
    message = str(refused.value)
    assert "at layer 1 the added vector (factor x vector, summed over spec(s) [0]) reaches 3e+39" in message
    assert f"a model computing in {dtype} holds it with room to spare only within {BOUNDS[dtype]}" in message
    summed = [Steering(2, [3000.0] * HIDDEN), Steering([0, 2], [3000.0] * HIDDEN)]  # 6000 at layer 2
    if dtype == "float16":
        with pytest.raises(ValueError, match=r"at layer 2 .* spec\(s\) \[0, 1\]\) reaches 6e\+03"):
            llm.generate(POISON, SamplingParams(**GREEDY), summed)
    else:
        llm.generate(POISON, SamplingParams(**GREEDY), summed, use_tqdm=False)
    assert llm.request_counter.counter == requests + (dtype != "float16")
    llm.reset_prefix_cache()
    assert tokens(llm.generate(prompts(), SamplingParams(**GREEDY), steering(HIDDEN), use_tqdm=False)) == reference


def poisoned_request(llm: SteeredVLLM) -> tuple[dict, SamplingParams]:
    """The refused steering, made into a request past the client's check (as if the bound were float64's)."""
    ids = llm.get_tokenizer()(POISON)["input_ids"]
    specs = [Steering(1, [3e38] * HIDDEN, factor=10)]
    wire, salt = request_steering(specs, LAYERS, HIDDEN, len(ids), torch.float64)
    return {"prompt_token_ids": ids, "cache_salt": salt}, SamplingParams(**GREEDY, extra_args={EXTRA_ARGS_KEY: wire})


def steered_requests(llm: SteeredVLLM) -> tuple[list[dict], list[SamplingParams]]:
    """`prompts` with their `steering`, as SteeredVLLM hands them to vLLM."""
    tokenizer = llm.get_tokenizer()
    made = [
        llm.steered_request({"prompt_token_ids": tokenizer(text)["input_ids"]}, SamplingParams(**GREEDY), specs or [])
        for text, specs in zip(prompts(), steering(HIDDEN))
    ]
    return [engine_input for engine_input, _, _ in made], [params for _, params, _ in made]


def test_a_stream_turned_non_finite_in_the_engine_changes_no_other_output(engine):
    llm, _, reference = engine
    poison, params = poisoned_request(llm)
    (own,) = LLM.generate(llm, [poison], params, use_tqdm=False)
    assert not math.isfinite(own.outputs[0].cumulative_logprob)  # its own stream did turn non-finite
    llm.reset_prefix_cache()  # later requests compute every block, in blocks the poisoned one held
    assert tokens(llm.generate(prompts(), SamplingParams(**GREEDY), steering(HIDDEN), use_tqdm=False)) == reference
    inputs, each = steered_requests(llm)
    llm.reset_prefix_cache()
    mixed = LLM.generate(llm, [poison, *inputs, poison], [params, *each, params], use_tqdm=False)
    assert tokens(mixed[1:-1]) == reference  # in the same batch as two poisoned requests
    assert not math.isfinite(mixed[0].outputs[0].cumulative_logprob)
    llm.reset_prefix_cache()
    assert tokens(llm.generate(prompts(), SamplingParams(**GREEDY), steering(HIDDEN), use_tqdm=False)) == reference


def test_steering_lists_that_fit_neither_reading_are_refused_naming_both(engine):
    llm, _, reference = engine
    requests = llm.request_counter.counter
    spec = Steering(0, torch.ones(HIDDEN))
    for steering_list, count in (([None] * 3, 2), ([spec, None], 3)):
        with pytest.raises(TypeError) as refused:
            llm.generate(prompts()[:count], SamplingParams(**GREEDY), steering_list)
        message = str(refused.value)
        assert f"steering is a list of {len(steering_list)} entries for {count} prompt(s)" in message
        each = "each None, a Steering (or Cap, Ablate, Clamp, Patch)"
        assert f"one entry per prompt (a list of {count}, {each}" in message
        assert "a list of specs (of any length) that steers every prompt with all of them" in message
    with pytest.raises(TypeError, match=r"steering\[1\]\[0\] is a str; a request's steering is None, a Steering"):
        llm.generate(prompts()[:2], SamplingParams(**GREEDY), [None, ["x"]])
    with pytest.raises(ValueError, match="on the meta device, which holds no values"):
        Steering(0, torch.ones(HIDDEN, device="meta"))
    assert llm.request_counter.counter == requests
    assert tokens(llm.generate(prompts(), SamplingParams(**GREEDY), steering(HIDDEN), use_tqdm=False)) == reference


def test_after_shutdown_every_call_says_the_engine_was_shut_down(engine):
    """Runs last for each engine: it shuts it down (the fixture's shutdown is idempotent)."""
    llm, _, _ = engine
    llm.shutdown()
    llm.shutdown()
    calls = [
        lambda: llm.generate(POISON, SamplingParams(**GREEDY)),
        lambda: LLM.generate(llm, POISON),
        lambda: llm.chat([{"role": "user", "content": POISON}]),
        llm.steering_stats,
    ]
    for call in calls:
        with pytest.raises(EngineShutDown, match=r"SteeredVLLM: this engine was stopped by shutdown\(\)"):
            call()
    assert llm.hidden_size == HIDDEN and llm.num_layers == LAYERS  # its config still answers
