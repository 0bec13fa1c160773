"""The memory model at the sizes users run, the steering pool, and what an engine allocates.

- ``nnterp-vllm plan`` on real configs (Llama-3.1-8B, Llama-3.1-70B at TP=8, Mixtral-8x7B, Qwen3-30B-A3B; no weights):
  the weights against the parameter counts their publishers give, this library's buffers within their bounds at
  vLLM's H100 defaults, and the plan's total plus vLLM's KV cache within ``gpu_memory_utilization``.
- What a SmolLM2 engine on the CPU build allocates equals what the memory model says for it, byte for byte.
- The steering pool (`steering_pool`): placement, sharing, waiting, release; on an engine whose pool is smaller than
  the distinct vectors offered, every request waits for room and none fails, each equal to transformers' hooks;
  six directions at one block; the pinned staging of an accelerator's writes.
- A last-position harvest equals the whole-sequence harvest's last rows.
"""

from __future__ import annotations

import json
import logging

import pytest
import reference
import tiny
import torch
from test_steering import engine_args, hooked_generation
from vllm import SamplingParams

from nnterp_vllm import Cap, Probe, SteeredVLLM, Steering
from nnterp_vllm.checkpoints import smollm2
from nnterp_vllm.cli import main
from nnterp_vllm.engines.steered import memory
from nnterp_vllm.engines.steered.memory import (
    EngineSizes,
    Ledger,
    default_steering_entries,
    engine_buffers,
    total,
)
from nnterp_vllm.engines.steered.planning import DEVICES, plan
from nnterp_vllm.engines.steered.steerer import Staging
from nnterp_vllm.engines.steered.steering_pool import PLACED, SteeringPool, needs
from nnterp_vllm.engines.steered.steering_table import SteeringTable, entry_content
from nnterp_vllm.specs.steering_requests import request_steering

MiB = 2**20
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
LLAMA_3_1_70B = {
    **LLAMA_3_1_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}
#: The parameter counts the models' publishers give (their model cards), an independent ground truth for the
#: weights the plan counts on the meta device.
PUBLISHED_PARAMETERS = {
    "llama-3.1-8b": (LLAMA_3_1_8B, 8_030_261_248),
    "llama-3.1-70b": (LLAMA_3_1_70B, 70_553_706_496),
    "mixtral-8x7b": (MIXTRAL_8X7B, 46_702_792_704),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, 30_532_122_624),
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("configs")
    written = {}
    for name, (config, _) in PUBLISHED_PARAMETERS.items():
        written[name] = directory / f"{name}.json"
        written[name].write_text(json.dumps(config))
    return written


def steering_bytes(buffers: dict, pinned: bool) -> int:
    return total([buffer for name, buffer in buffers.items() if name.startswith("steering")], pinned)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_the_plan_of_a_real_config_counts_its_weights_and_keeps_within_the_device(configs, name):
    parallel = 8 if name == "llama-3.1-70b" else 1
    made = plan(str(configs[name]), "h100", parallel, capture_values=["layers.*.layer_output"])
    assert (made.max_num_batched_tokens, made.max_num_seqs) == (16384, 1024)  # vLLM's own H100 defaults
    published = PUBLISHED_PARAMETERS[name][1]
    assert made.weights == published * 2 // parallel  # bfloat16, split over the ranks
    # The steering pool of the default size is a rounding error: within 64 MiB of the device and 64 MiB pinned.
    for buffers in filter(None, (made.first_rank, made.other_ranks)):
        assert steering_bytes(buffers, pinned=False) <= 64 * MiB
        assert steering_bytes(buffers, pinned=True) <= 64 * MiB
    # The plan's total and vLLM's KV cache never above gpu_memory_utilization of the device.
    assert made.weights + made.activations + made.ours + made.kv_cache == made.budget
    assert made.budget <= 0.92 * DEVICES["h100"].memory
    if name == "mixtral-8x7b":  # 87 GiB of weights: not on one H100
        assert made.kv_cache < 0 and made.kv_tokens == 0
    else:
        assert made.kv_tokens > 10_000


def test_a_whole_residual_capture_of_the_8b_model_is_accounted_and_its_host_side_is_bounded(configs):
    made = plan(str(configs["llama-3.1-8b"]), "h100", capture_values=["layers.*.layer_output"])
    buffers = made.first_rank
    whole = 32 * 16384 * 4096 * 2  # every block's stream, every token of vLLM's largest step, bfloat16
    assert buffers["capture buffer"].nbytes == buffers["capture compact rows"].nbytes == whole
    assert buffers["capture rows on the host"].nbytes <= buffers["capture compact rows"].nbytes  # one compact step
    assert total(buffers.values(), pinned=True) <= 128 * MiB
    # Under tensor parallelism only the first rank keeps rows.
    split = plan(str(configs["llama-3.1-70b"]), "h100", 8, capture_values=["layers.*.layer_output"])
    assert "capture buffer" in split.first_rank and "capture buffer" not in split.other_ranks


def test_the_plan_follows_vllms_defaults_per_device_and_the_callers_settings(configs):
    path = str(configs["llama-3.1-8b"])
    assert (plan(path, "h100", server=True).max_num_batched_tokens, plan(path, "h100").max_num_seqs) == (8192, 1024)
    assert (plan(path, "a100-80g").max_num_batched_tokens, plan(path, "a100-80g").max_num_seqs) == (8192, 256)
    assert plan(path, "b200", server=True).max_num_batched_tokens == 16384
    chosen = plan(path, "h200", max_steering_entries=100, directions_per_block=6, max_num_batched_tokens=4096)
    vectors = chosen.first_rank["steering vectors"]
    assert vectors.shape == (101, 13, 4096) and chosen.first_rank["steering token rows"].shape == (4096,)
    assert chosen.device_memory == DEVICES["h200"].memory


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"device": "h800"}, "device must be one of h100, h200, a100-80g, b200"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an int >= 1, got 0"),
        ({"max_steering_entries": -3}, "max_steering_entries must be an int >= 1"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"dtype": "int8"}, "dtype must be a floating dtype's name"),
        ({"capture_values": ["layers.*.self_attn.attention_queries"]}, "is not kept by the engine"),
    ],
)
def test_bad_plan_arguments_are_refused_naming_them(configs, arguments, message):
    with pytest.raises(ValueError, match=message):
        plan(str(configs["llama-3.1-8b"]), **arguments)


def test_a_config_without_model_type_is_refused(tmp_path):
    broken = tmp_path / "config.json"
    broken.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="names no model_type; give a model's config.json"):
        plan(str(broken))


def test_nnterp_vllm_plan_prints_the_buffers_and_the_kv_cache(configs, capsys):
    path = str(configs["llama-3.1-70b"])
    assert main(["plan", path, "--tensor-parallel-size", "8", "--capture-values", "layers.40.layer_output"]) == 0
    printed = capsys.readouterr().out
    assert "This library's buffers, rank 0:" in printed and "ranks 1..7:" in printed
    assert "capture buffer" in printed and "shrink: max_steering_entries" in printed
    assert "vLLM's KV cache (what is left)" in printed
    assert main(["plan", path, "--json", "--tensor-parallel-size", "8"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["weights"] == 70_553_706_496 * 2 // 8 and data["kv_tokens"] > 0
    assert main(["plan", path, "--device", "h100", "--tensor-parallel-size", "0"]) == 2
    assert "tensor_parallel_size must be an int >= 1" in capsys.readouterr().err


# -- what an engine allocates -------------------------------------------------------------------------------------


def test_a_smollm2_engine_allocates_what_the_memory_model_says_byte_for_byte():
    """On the CPU build, the README's engine (every block's stream kept): each buffer the worker allocated, its shape,
    dtype and bytes, against the memory model fed the checkpoint's config and the engine's scheduler settings. Eager:
    the buffers are allocated as the model loads, before anything compiles it."""
    from transformers import AutoConfig

    llm = SteeredVLLM(
        smollm2(), dtype="float32", max_model_len=512, capture_values=["layers.*.layer_output"], enforce_eager=True
    )
    try:
        (allocated,) = llm.collective_rpc("allocated_buffers")
        scheduler = llm.vllm_config.scheduler_config
    finally:
        llm.shutdown()
    config = AutoConfig.from_pretrained(smollm2())
    sizes = EngineSizes(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        dtype=torch.float32,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        max_num_seqs=scheduler.max_num_seqs,
        steering_entries=default_steering_entries(config.hidden_size, torch.float32, 2),
        directions_per_block=2,
        kept_values=config.num_hidden_layers,
        saes=(),
        accelerator=False,
        probe_columns=memory.PROBE_COLUMNS,
    )
    expected = engine_buffers(sizes)
    assert set(allocated) == set(expected)
    for name, buffer in expected.items():
        held = allocated[name]
        assert (held["nbytes"], held["shape"], held["dtype"]) == (
            buffer.nbytes,
            list(buffer.shape),
            str(buffer.dtype).removeprefix("torch."),
        ), name
        assert held["host"] is buffer.pinned is False


# -- the steering pool ----------------------------------------------------------------------------------------------


def wire(vectors: list[torch.Tensor], layers: list[int], positions: list = None, length: int = 8) -> dict:
    """A request's steering in engine form: one `Steering` per vector, at ``layers``."""
    specs = [
        Steering(layers, vector, positions=(positions or ["all"] * len(vectors))[i]) for i, vector in enumerate(vectors)
    ]
    steering, _ = request_steering(specs, 4, 8, length)
    return steering


def test_the_pool_shares_content_waits_for_room_and_takes_it_back():
    generator = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(8, generator=generator) for _ in range(3))
    pool = SteeringPool(num_layers=4, rows=8, entries=2, writes_per_step=8)
    first, same = wire([a], [0, 2]), wire([a], [0, 2])
    # One spec at two blocks: one row naming one entry at both.
    assert pool.admit("first", first) and pool.admit("same", same)
    assert first[PLACED]["entries"] == same[PLACED]["entries"] and len(first[PLACED]["entries"]) == 1
    (row, _, at) = first[PLACED]["rows"][0]
    assert first[PLACED]["prompt"] == first[PLACED]["generated"] == row and {layer for layer, _ in at} == {0, 2}
    assert pool.admit("second", wire([b], [1]))
    # The pool is full: a third content waits, and a request needing new content behind it waits too.
    assert not pool.admit("third", wire([c], [1])) and not pool.admit("fourth", wire([c, a], [3]))
    assert pool.admit("plain", None) and pool.waits == 2
    pool.new_step()
    assert not pool.admit("third", wire([c], [1]))
    pool.release("second")
    pool.new_step()
    third = wire([c], [1])
    assert pool.admit("third", third)  # the idle entry of the second request, taken back
    pool.release("first"), pool.release("same")
    # Content released and idle is resident still: placed again at the same entry, not written anew.
    again = wire([a], [0, 2])
    pool.new_step()
    assert pool.admit("again", again) and again[PLACED]["entries"] == first[PLACED]["entries"]


def test_a_row_whose_entry_was_placed_elsewhere_is_written_again():
    """A row left resident after its entry's id went to other content names the entry's new id, not the old."""
    generator = torch.Generator().manual_seed(9)
    a, b, c = (torch.randn(8, generator=generator) for _ in range(3))
    pool = SteeringPool(num_layers=4, rows=8, entries=2, writes_per_step=8)
    first = wire([a], [1])
    assert pool.admit("a", first)
    pool.release("a")
    for name, vector in (("b", b), ("c", c)):  # two new contents take both entries: a's content is gone
        pool.new_step()
        assert pool.admit(name, wire([vector], [1]))
    pool.release("b"), pool.release("c")
    pool.new_step()
    again = wire([a], [1])
    assert pool.admit("again", again)
    ((entry, _, _, _),) = again[PLACED]["entries"]
    ((row, name, at),) = again[PLACED]["rows"]
    assert at == [[1, entry]] and name != first[PLACED]["rows"][0][1]  # a row content of its own, naming it


def test_new_content_of_one_step_is_bounded_by_the_staging_except_for_one_request_alone():
    generator = torch.Generator().manual_seed(1)
    vectors = [torch.randn(8, generator=generator) for _ in range(5)]
    pool = SteeringPool(num_layers=4, rows=16, entries=16, writes_per_step=4)
    assert pool.admit("big", wire(vectors[:3], [0], positions=[[0], [1], [2]]))  # 3 rows and 3 entries, alone
    assert not pool.admit("next", wire(vectors[3:4], [1]))  # the step's staging is used up
    pool.new_step()
    assert pool.admit("next", wire(vectors[3:4], [1]))


def test_needs_names_each_token_set_and_each_blocks_content():
    generator = torch.Generator().manual_seed(2)
    a, b = torch.randn(8, generator=generator), torch.randn(8, generator=generator)
    steering, _ = request_steering(
        [Steering([0, 1], a), Steering(1, b, positions="generated"), Cap(a, 1, max=0.5, positions=[3])], 4, 8, 6
    )
    wanted = needs(steering, 4)
    assert wanted.prompt != wanted.generated and set(wanted.listed) == {3}
    assert len(wanted.rows) == 3
    # The same spec at two blocks, in any row, is one entry.
    prompt, generated, listed = (wanted.rows[key] for key in (wanted.prompt, wanted.generated, wanted.listed[3]))
    assert prompt[0] == prompt[1] == generated[0] == listed[0]
    assert len(wanted.entries) == 3 and len({prompt[1], generated[1], listed[1]}) == 3  # a; a + b; a, then the cap


def counting_device():
    """A stand-in accelerator (`test_gpu_paths.stand_in_device`) counting the waits for its events."""
    from test_gpu_paths import stand_in_device

    device = stand_in_device()

    class Event(device.Event):
        synchronized = 0

        def synchronize(self) -> None:
            type(self).synchronized += 1
            super().synchronize()

    device.Event = Event
    return device


def test_every_probe_column_is_a_row_of_the_engines_probe_buffers():
    """A pool of three probe columns places a request reading all three at ids 0, 1 and 2: the rows of the engine's
    buffers, which hold ``max_probe_columns`` of them."""
    probe = Probe(torch.ones(8, 3)).resolved("three", 4, 8)
    probes = {"key": "k", "prompt_tokens": 8, "probes": [{**probe, "positions": "all"}]}
    pool = SteeringPool(num_layers=4, rows=8, entries=0, writes_per_step=8, columns=3)
    assert pool.admit("all three", None, probes)
    ((name, columns),) = probes[PLACED]["probes"]
    assert name == "three" and sorted(columns) == [0, 1, 2]


def test_an_accelerators_new_content_goes_through_the_pinned_staging_and_waits_only_when_it_is_full(monkeypatch):
    monkeypatch.setattr(memory, "STEERING_WRITES_PER_STEP", 6)
    sizes = EngineSizes(3, 16, torch.float32, 32, 4, 8, 2, 0, (), accelerator=True)
    ledger = Ledger(engine_buffers(sizes), "cpu")
    table = SteeringTable(ledger, {}, None)
    staging = Staging(ledger)
    staging.device = counting_device()
    assert staging.vectors.shape[0] == sizes.steering_writes == 6
    generator = torch.Generator().manual_seed(3)
    specs = [
        request_steering([Steering(0, torch.randn(16, generator=generator))], 3, 16, 4)[0]["specs"] for _ in range(8)
    ]
    staging.new_step()
    for entry, spec in enumerate(specs, start=1):
        content, parameters, keep, relative = entry_content(spec, 16, 2)
        staging.entry(table, entry, content, parameters, keep, relative)
    assert staging.device.Event.synchronized == 1  # the seventh write waited for the first six copies
    for entry, spec in enumerate(specs, start=1):
        content, _, keep, relative = entry_content(spec, 16, 2)
        torch.testing.assert_close(table.vectors[entry], content)
        assert float(table.keep[entry]) == keep == 1.0 and float(table.relative[entry]) == relative == 0.0
    staging.new_step()
    placed = torch.arange(table.rows.shape[0], dtype=torch.int32) % 4
    staging.row(table, 5, placed)
    assert table.rows[:, 5].tolist() == placed.tolist() and staging.device.Event.synchronized == 1


#: Room for four distinct contents, and six directions at one block.
SMALL_POOL = {"max_steering_entries": 4, "steering_directions_per_block": 6}


@pytest.fixture(scope="module")
def small_pool():
    """An engine whose pool holds four entries, eager: the pool is placed by the scheduler and read by the same
    operations compiled or not (tests/test_steering.py runs them compiled)."""
    path = tiny.checkpoint("llama")
    llm = SteeredVLLM(path, **engine_args("llama"), **SMALL_POOL, enforce_eager=True)
    yield path, llm
    llm.shutdown()


def greedy_with_logprobs(llm, prompts, steering) -> list[tuple[list[int], torch.Tensor]]:
    from test_steering import STEPS, tokens_and_logprobs

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    return [tokens_and_logprobs(output) for output in llm.generate(prompts, params, steering, use_tqdm=False)]


def test_requests_wait_for_room_in_a_pool_smaller_than_their_vectors_and_none_fails(small_pool):
    path, llm = small_pool
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    waits = scheduler.steering_pool.waits
    generator = torch.Generator().manual_seed(4)
    prompts = [f"{reference.PROMPT} {i}" for i in range(12)]
    specs = [[Steering(1, torch.randn(llm.hidden_size, generator=generator), factor=3.0)] for _ in prompts]
    outputs = greedy_with_logprobs(llm, prompts, specs)  # twelve distinct vectors, four entries
    assert scheduler.steering_pool.waits > waits
    tokenizer = llm.get_tokenizer()
    for prompt, spec, (tokens, logprobs) in zip(prompts, specs, outputs):
        expected, expected_logprobs = hooked_generation(path, tokenizer(prompt)["input_ids"], spec, {})
        assert tokens == expected
        torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-4, rtol=1e-4)
    (stats,) = llm.steering_stats()
    assert stats["entries"] == 4 and stats["entry_writes"] >= 12


def test_six_directions_at_one_block_apply_in_turn_as_hooks_apply_them(small_pool):
    path, llm = small_pool
    generator = torch.Generator().manual_seed(5)
    specs = [Steering(1, torch.randn(llm.hidden_size, generator=generator), factor=2.0)]
    specs += [Cap(torch.randn(llm.hidden_size, generator=generator), 1, min=-0.05, max=0.05) for _ in range(6)]
    ((tokens, logprobs),) = greedy_with_logprobs(llm, [reference.PROMPT], [specs])
    expected, expected_logprobs = hooked_generation(path, llm.get_tokenizer()(reference.PROMPT)["input_ids"], specs, {})
    assert tokens == expected
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-4, rtol=1e-4)


def test_a_vector_whose_entry_was_evicted_steers_as_hooks_do_when_it_comes_back(small_pool):
    path, llm = small_pool
    generator = torch.Generator().manual_seed(10)
    vector = torch.randn(llm.hidden_size, generator=generator)
    prompt = reference.PROMPT
    (first,) = greedy_with_logprobs(llm, [prompt], [[Steering(1, vector, factor=3.0)]])
    others = [[Steering(1, torch.randn(llm.hidden_size, generator=generator), factor=3.0)] for _ in range(6)]
    greedy_with_logprobs(llm, [f"{prompt} {i}" for i in range(6)], others)  # six contents through four entries
    (again,) = greedy_with_logprobs(llm, [prompt], [[Steering(1, vector, factor=3.0)]])
    expected, expected_logprobs = hooked_generation(
        path, llm.get_tokenizer()(prompt)["input_ids"], [Steering(1, vector, factor=3.0)], {}
    )
    assert first[0] == again[0] == expected
    torch.testing.assert_close(again[1], expected_logprobs, atol=1e-4, rtol=1e-4)


def test_a_request_larger_than_the_whole_pool_is_refused_naming_the_setting(small_pool):
    _, llm = small_pool
    generator = torch.Generator().manual_seed(6)
    requests = llm.request_counter.counter
    specs = [Steering(1, torch.randn(llm.hidden_size, generator=generator), positions=[i]) for i in range(5)]
    with pytest.raises(ValueError, match=r"need 5 distinct block contents .* holds 4; .* max_steering_entries=N"):
        llm.generate(reference.PROMPT, SamplingParams(max_tokens=2), specs)
    assert llm.request_counter.counter == requests


# -- saved graphs ---------------------------------------------------------------------------------------------------


def test_steered_engines_compile_without_vllms_saved_graphs_on_every_platform(monkeypatch, caplog):
    from nnterp_vllm.engines.steered.steered_settings import steering_settings

    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    with caplog.at_level(logging.INFO, logger="nnterp_vllm.engines.vllm_environment"):
        steering_settings(tiny.checkpoint("llama"), {})
    import os

    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    assert "VLLM_USE_AOT_COMPILE=1 overridden" in caplog.text and "without vLLM's ahead-of-time artifact" in caplog.text


# -- last positions ---------------------------------------------------------------------------------------------


def test_a_last_position_harvest_equals_the_whole_sequence_harvests_last_rows(tmp_path):
    from test_harvest import documents

    from nnterp_vllm.harvest import harvest

    path = tiny.checkpoint("llama")
    docs = documents(16, seed=7)
    options = {"engine": "vllm", "progress": False, "model_kwargs": {"dtype": "float32"}}
    whole = harvest(path, docs, ["layers.*.layer_output"], tmp_path / "all", **options)
    last = harvest(path, docs, ["layers.*.layer_output"], tmp_path / "last", positions="last", **options)
    documents_column = whole.load("documents")
    ends = [int((documents_column == doc).nonzero().max()) for doc in last.load("documents").tolist()]
    assert len(last) == len(ends) == sum(1 for doc in docs if doc)
    for name in whole.values:  # two runs of the engine: float32 sums may be ordered apart, nothing more
        torch.testing.assert_close(last.load(name), whole.load(name)[ends], atol=1e-6, rtol=1e-5)


def test_memory_constants_keep_the_host_side_within_one_compact_step():
    sizes = EngineSizes(2, 64, torch.float16, 8, 4, 8, 2, 1, (), accelerator=True)
    buffers = engine_buffers(sizes)
    assert buffers["capture rows on the host"].nbytes <= buffers["capture compact rows"].nbytes
    assert memory.HOST_BUFFERS * memory.HOST_CHUNK_BYTES <= 64 * MiB
