"""vLLM's GPU code paths, checked on its CPU build: what a CUDA node runs that this machine can emulate.

- The model-runner choice: vLLM picks its V2 runner wherever Triton works (every CUDA node); every engine of ours
  chooses the V1 runner before vLLM's config is made, here with vLLM's config made to prefer V2 as it does there.
- Off the CPU platform (a subprocess whose vLLM reports a CUDA platform), building every worker class the engines
  would use imports nothing of vLLM's CPU worker, which would replace ``torch.cuda``'s events and streams.
- Under CUDA graphs vLLM's GPU runner wraps the model in its ``CUDAGraphWrapper``: the steered engine with the
  model wrapped as ``GPUModelRunner.load_model`` wraps it steers and captures exactly as the unwrapped one.
- Kept rows leaving an accelerator (`RowsLeaving`): only the rows some request keeps, gathered into a compact
  buffer, copied a bounded part at a time on a stream of their own and handed on only once each copy's event has
  completed, in step order, by a writer thread (into a harvest's file region too, its failures raised on the
  engine's thread), with a stand-in for the device's streams and events.
- The device-memory check of the steered engine's buffers (the memory model's, `memory`), and the share of a
  device the notebook engine takes.
"""

from __future__ import annotations

import errno
import json
import logging
import subprocess
import sys
import threading
import time

import pytest
import tiny
import torch
from vllm import SamplingParams

from nnterp_vllm import Capture, StandardizedVLLM, SteeredVLLM, Steering
from nnterp_vllm.engines.lifecycle import shutdown
from nnterp_vllm.engines.steered import memory
from nnterp_vllm.engines.steered.kept_delivery import KeptRows, Piece, RowsLeaving
from nnterp_vllm.engines.steered.memory import (
    EngineSizes,
    Ledger,
    check_room,
    engine_buffers,
)
from nnterp_vllm.engines.steered.shared_rows import Region, SharedRows, open_region
from nnterp_vllm.engines.vllm_environment import RUNNER_SETTING

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
PROMPTS = ["The quick brown fox jumps", "A cup of coffee", "Rome was not built in a day, they say"]


@pytest.fixture(scope="module")
def path():
    return tiny.checkpoint("llama")


@pytest.fixture
def vllm_prefers_v2(monkeypatch):
    """vLLM's config as it is wherever Triton works: the V2 runner unless ``VLLM_USE_V2_MODEL_RUNNER`` says not."""
    from vllm import envs
    from vllm.config import VllmConfig
    from vllm.config import vllm as vllm_config_module

    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.setattr(VllmConfig, "_get_v2_model_runner_unsupported_features", lambda self: [])
    monkeypatch.delenv(RUNNER_SETTING, raising=False)
    envs.disable_envs_cache()  # an engine built earlier in this process cached the environment it saw


def test_vllm_prefers_its_v2_runner_where_triton_works(vllm_prefers_v2, path):
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(path), kv_cache_memory_bytes=2**24, enforce_eager=True).create_engine_config()
    assert config.use_v2_model_runner


@pytest.mark.parametrize("engine", [SteeredVLLM, StandardizedVLLM])
def test_every_engine_chooses_the_v1_runner_before_its_config_and_says_so(vllm_prefers_v2, path, engine, caplog):
    with caplog.at_level(logging.INFO, logger="nnterp_vllm.engines.vllm_environment"):
        if engine is SteeredVLLM:
            model = SteeredVLLM(path, enforce_eager=True, max_model_len=128)
            config = model.llm_engine.vllm_config
            steered = model.generate(PROMPTS[:1], SamplingParams(**GREEDY), Steering(0, [1.0] * 128), use_tqdm=False)
            assert len(steered[0].outputs[0].token_ids) == GREEDY["max_tokens"]
            model.shutdown()
        else:
            model = StandardizedVLLM(str(path), dispatch=True, max_model_len=128)
            config = model.vllm_entrypoint.llm_engine.vllm_config
            with model.trace(PROMPTS[0]):
                out = model.layers[0].layer_output.save()
            assert out.shape[-1] == 128
            shutdown(model)
    assert not config.use_v2_model_runner
    said = [record.getMessage() for record in caplog.records if "V1 model runner" in record.getMessage()]
    assert len(said) == 1 and RUNNER_SETTING in said[0], said


def test_asking_for_the_v2_runner_is_refused_naming_the_setting(monkeypatch, path):
    monkeypatch.setenv(RUNNER_SETTING, "1")
    with pytest.raises(NotImplementedError, match=f"{RUNNER_SETTING}='1'.*Unset {RUNNER_SETTING}"):
        SteeredVLLM(path, enforce_eager=True)
    with pytest.raises(NotImplementedError, match=f"{RUNNER_SETTING}='1'"):
        StandardizedVLLM(str(path), dispatch=True)


#: Run in a fresh interpreter whose vLLM reports a CUDA platform: build every worker class the engines would use.
OFF_CPU = """
import json, sys, torch

def torch_as_it_is():
    cuda = {n: getattr(torch.cuda, n) for n in ("Event", "Stream", "current_stream", "stream")}
    accelerator = {"accelerator." + n: getattr(torch.accelerator, n) for n in ("synchronize", "empty_cache")}
    return {**cuda, **accelerator, "accelerator.get_memory_info": torch.accelerator.get_memory_info,
            "Tensor.pin_memory": torch.Tensor.pin_memory}

before = torch_as_it_is()
# vLLM's GPU worker and runner modules, imported as this CPU build can (their GPU kernels are not here); from now
# on vLLM reports a CUDA platform, and everything this project builds is built as it would be there.
import vllm.v1.worker.gpu_worker, vllm.v1.worker.gpu_model_runner
import nnsight.modeling.vllm.workers.GPUWorker
from vllm import platforms
from vllm.platforms.interface import Platform, PlatformEnum

class StandInCuda(Platform):
    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"
    dispatch_key = "CUDA"

vllm_modules_before = {m for m in sys.modules if m.startswith("vllm.v1.worker.cpu")}
platforms._current_platform = StandInCuda()
import nnterp_vllm
from nnterp_vllm.engines import engine_defaults, vllm_platform, worker_classes
from nnterp_vllm.engines.steered import engine, runners
from nnterp_vllm.engines.steered.steered_settings import steering_settings
from nnterp_vllm.serve import server
from vllm.utils.import_utils import resolve_obj_by_qualname

kwargs = engine_defaults.engine_kwargs(sys.argv[1], dtype="float32")
shares = [engine_defaults.notebook_share(given, "StandardizedVLLM")
          for given in ({}, {"gpu_memory_utilization": 0.8}, {"kv_cache_memory_bytes": 2**30})]
worker = worker_classes.worker_class()
steered_worker = steering_settings(sys.argv[1], {"dtype": "float32"})["worker_cls"]
built = [resolve_obj_by_qualname(path).__name__ for path in (
    worker, steered_worker, "nnterp_vllm.engines.steered.runners.EngineGPUModelRunner")]
after = torch_as_it_is()
print(json.dumps({
    "cpu_platform": vllm_platform.is_cpu_platform(),
    "built": built,
    "worker": worker,
    "steered_worker": steered_worker,
    "engine_kwargs": kwargs,
    "shares": shares,
    "cpu_modules_before": sorted(vllm_modules_before),
    "cpu_modules": sorted(m for m in sys.modules if m.startswith("vllm.v1.worker.cpu") or "cpu_executors" in m),
    "replaced": sorted(name for name in before if after[name] is not before[name]),
}))
"""


def test_off_the_cpu_platform_no_cpu_worker_module_is_imported_and_torch_is_left_alone(path):
    done = subprocess.run(
        [sys.executable, "-c", OFF_CPU, str(path)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["cpu_platform"] is False
    assert found["built"] == ["EngineGPUWorker", "EngineGPUWorker", "EngineGPUModelRunner"]
    # One worker for every engine: the notebook engine's and the steered engine's.
    assert found["worker"] == found["steered_worker"] == "nnterp_vllm.engines.steered.runners.EngineGPUWorker"
    assert found["engine_kwargs"] == {"dtype": "float32"}  # no CPU executor, no CPU KV-cache sizing
    # The notebook engine takes its share of the device unless told; a caller's sizing wins.
    assert found["shares"] == [
        {"gpu_memory_utilization": 0.5},
        {"gpu_memory_utilization": 0.8},
        {"kv_cache_memory_bytes": 2**30},
    ]
    assert found["cpu_modules_before"] == found["cpu_modules"] == []
    assert found["replaced"] == []


# -- the model wrapped as vLLM's GPU runner wraps it under CUDA graphs ---------------------------------------------


def wrap_as_under_cuda_graphs(monkeypatch) -> list:
    """Make the CPU runner load as ``GPUModelRunner.load_model`` does under CUDA graphs: the loaded model wrapped in
    vLLM's ``CUDAGraphWrapper`` (runtime mode FULL; the CPU's forward context carries mode NONE, so it calls straight
    through), and ``get_model()`` unwrapping it as the GPU runner's does. Returns the list of wrappers built."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wrapped = []
    load = CPUModelRunner.load_model

    def load_and_wrap(self, *args, **kwargs):
        load(self, *args, **kwargs)
        self.model = CUDAGraphWrapper(self.model, self.vllm_config, runtime_mode=CUDAGraphMode.FULL)
        wrapped.append(self.model)

    monkeypatch.setattr(type(current_platform), "graph_pool_handle", lambda self: None, raising=False)
    monkeypatch.setattr(CPUModelRunner, "load_model", load_and_wrap)
    monkeypatch.setattr(CPUModelRunner, "get_model", GPUModelRunner.get_model)
    return wrapped


def steered_run(path) -> tuple[list[list[int]], list[dict[str, torch.Tensor]], dict]:
    """Greedy tokens and kept rows of a few steered and capturing requests on a fresh (compiled) steered engine, and
    its steering statistics (with the capture operations' runs outside the compiled graph)."""
    model = SteeredVLLM(path, capture_values=["layers.*.layer_output", "layers.1.mlp.mlp_output"], max_model_len=128)
    vector = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(0))
    steering = [[Steering(1, vector, factor=4.0)], None, [Steering(0, vector, positions="generated")]]
    capture = [Capture("layers.*.layer_output"), Capture("layers.1.mlp.mlp_output", positions="last"), None]
    try:
        outputs = model.generate(PROMPTS, SamplingParams(**GREEDY), steering, capture=capture, use_tqdm=False)
        stats = {**model.steering_stats()[0], "capture_eager_calls": model.capture_stats()[0]["eager_calls"]}
    finally:
        model.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs], [o.activations or {} for o in outputs], stats


def test_the_steered_engine_steers_and_captures_inside_vllms_cuda_graph_wrapper(path, monkeypatch):
    plain_tokens, plain_kept, _ = steered_run(path)
    wrapped = wrap_as_under_cuda_graphs(monkeypatch)
    tokens, kept, stats = steered_run(path)
    assert len(wrapped) == 1
    assert tokens == plain_tokens
    assert stats["entry_writes"] >= 1 and stats["eager_calls"] == stats["capture_eager_calls"] == 0
    for inside, plain in zip(kept, plain_kept):
        assert inside.keys() == plain.keys()
        for name in inside:
            torch.testing.assert_close(inside[name], plain[name], atol=1e-5, rtol=1e-5)
    assert kept[0]["layers.0.layer_output"].shape[0] == len(tokens[0]) + len(PROMPTS[0]) - 1


def test_the_nnsight_engine_reads_the_model_inside_vllms_cuda_graph_wrapper(path, monkeypatch):
    from transformers import AutoModelForCausalLM

    wrapped = wrap_as_under_cuda_graphs(monkeypatch)
    model = StandardizedVLLM(str(path), dispatch=True, max_model_len=128, dtype="float32")
    try:
        with model.trace(PROMPTS[0]):
            streams = [model.layers[i].layer_output.save() for i in range(model.num_layers)]
        ids = model.tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"]
    finally:
        shutdown(model)
    assert len(wrapped) == 1
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states
    for layer, stream in enumerate(streams[:-1]):
        torch.testing.assert_close(stream[0], hidden[layer + 1][0], atol=1e-4, rtol=1e-4)


# -- kept rows leaving an accelerator -----------------------------------------------------------------------------


class StandInDevice:
    """An accelerator's torch module as `RowsLeaving` uses it, on the CPU: copies happen at once, but each event
    reports completion only on its second ``query`` (a copy still on its way) or once waited for, and says
    whether it was."""

    class Event:
        def __init__(self) -> None:
            self.asked = 0
            self.waited = False

        def record(self, stream: object = None) -> None:
            pass

        def query(self) -> bool:
            self.asked += 1
            return self.asked > 1

        def synchronize(self) -> None:
            self.waited = True

    class Stream:
        def __init__(self, device: object = None) -> None:
            self.waits: list[object] = []

        def wait_event(self, event: object) -> None:
            self.waits.append(event)

    compute = Stream()

    @classmethod
    def current_stream(cls, device: object = None) -> Stream:
        return cls.compute

    @staticmethod
    def stream(stream: object):
        import contextlib

        return contextlib.nullcontext()


def stand_in_device() -> type[StandInDevice]:
    """A `StandInDevice` whose compute stream is its own (its waits counted from none)."""
    return type("Device", (StandInDevice,), {"compute": StandInDevice.Stream()})


def leaving_rows(values: int, tokens: int, hidden: int, device: object) -> tuple[torch.Tensor, RowsLeaving]:
    """A capture buffer and its way off a stand-in accelerator, allocated as the engine allocates them (`Ledger`)."""
    sizes = EngineSizes(3, hidden, torch.float32, tokens, 4, 8, 1, values, (), accelerator=True)
    ledger = Ledger(engine_buffers(sizes), "cpu")
    rows = ledger.allocate("capture buffer")
    return rows, RowsLeaving(rows, ledger, device)


def sent_steps(leaving: RowsLeaving, rows: torch.Tensor, requests: list[KeptRows], steps: int) -> list[torch.Tensor]:
    """Run ``steps`` steps of two tokens per request through ``leaving`` as the engine does, each request keeping its
    next two rows; each step's rows as its forward wrote them."""
    written = []
    for step in range(steps):
        rows.copy_(torch.randn(rows.shape))  # the step's forward writes the buffer
        written.append(rows[:, : 2 * len(requests)].clone())
        leaving.send([(request, 2 * i, 2 * step, 2) for i, request in enumerate(requests)], 2 * len(requests))
        rows.fill_(-1.0)  # the next forward overwrites it before the rows are handed on
    return written


def kept_request(values: int, hidden: int, slots: list[int] | None = None) -> KeptRows:
    """A request keeping ``values`` values, with room for its first step, as vLLM's runner makes it."""
    with torch.inference_mode():
        tensors = [torch.zeros(2, hidden) for _ in range(values)]
    return KeptRows({"values": [f"v{i}" for i in range(values)]}, slots or list(range(values)), tensors)


def test_only_the_kept_rows_leave_the_device_handed_on_in_order_once_arrived(monkeypatch):
    values, tokens, hidden, steps = 3, 8, 4, 5
    # Host buffers of three rows: each step's twelve kept rows go off the device in four parts.
    monkeypatch.setattr(memory, "HOST_CHUNK_BYTES", 3 * hidden * 4)
    device = stand_in_device()
    rows, leaving = leaving_rows(values, tokens, hidden, device)
    assert tuple(leaving.hosts.shape) == (2, 3, hidden)
    copies, write = [], Piece.write

    def written_once_arrived(self: Piece, part: torch.Tensor) -> None:
        # Every copy to the host recorded so far but the newest two (the host buffers in flight) was waited for.
        assert all(event.waited for event in copies[:-2])
        write(self, part)

    record = device.Event.record

    def recorded(self, stream: object = None) -> None:
        if stream is leaving.stream:
            copies.append(self)
        record(self, stream)

    monkeypatch.setattr(device.Event, "record", recorded)
    monkeypatch.setattr(Piece, "write", written_once_arrived)
    requests = [kept_request(values, hidden), kept_request(values, hidden, slots=[2, 0, 1])]
    written = sent_steps(leaving, rows, requests, steps)
    leaving.deliver(wait=True)
    assert leaving.moved == steps * 2 * 2 * values  # each step: two rows of every value of two requests, no more
    for index, request in enumerate(requests):
        assert request.filled == 2 * steps
        for step, expected in enumerate(written):
            for value, slot in enumerate(request.slots):
                torch.testing.assert_close(
                    request.tensors[value][2 * step : 2 * step + 2], expected[slot, 2 * index : 2 * index + 2]
                )
    # Every gather after the first waited (on the device) for the last copy out of the compact buffer.
    assert len(device.compute.waits) == steps - 1
    leaving.close()
    assert not leaving.writer.is_alive()
    assert len(copies) == steps * 4 and all(event.waited for event in copies)


def test_rows_the_writer_thread_is_writing_survive_the_request_growing_meanwhile(monkeypatch):
    """The engine's thread grows a request's tensors (`KeptRows.room`) for the next step while the writer thread
    is halfway through writing the previous step's rows into them: the growth waits for the write, and keeps it."""
    request = kept_request(1, hidden=4)
    request.filled = 2
    rows = torch.arange(8.0).reshape(2, 4)
    halfway, go_on = threading.Event(), threading.Event()
    copy = torch.Tensor.copy_

    def held_copy(target: torch.Tensor, source: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if threading.current_thread().name == "writer":
            halfway.set()
            go_on.wait(10)
        return copy(target, source, *args, **kwargs)

    def write() -> None:
        with torch.inference_mode():  # as the writer thread writes (`RowsLeaving`): the tensors are inference tensors
            Piece(request, None, 0, 0, 0, 0, 2).write(rows)

    monkeypatch.setattr(torch.Tensor, "copy_", held_copy)
    writer = threading.Thread(target=write, name="writer")
    writer.start()
    assert halfway.wait(10)
    grower = threading.Thread(target=request.room, args=(4,))
    grower.start()
    grower.join(0.5)  # unguarded, the growth would finish here, copying the rows from before the write
    go_on.set()
    writer.join(10)
    grower.join(10)
    assert request.tensors[0].shape[0] == 4
    torch.testing.assert_close(request.tensors[0][:2], rows)


def test_a_last_position_step_moves_one_row_per_request_and_value():
    values, tokens, hidden = 4, 16, 8
    rows, leaving = leaving_rows(values, tokens, hidden, stand_in_device())
    requests = [kept_request(values, hidden) for _ in range(3)]
    rows.copy_(torch.randn(rows.shape))
    expected = rows.clone()
    # Three prompts of five tokens in one step, each keeping its last token's row of every value.
    leaving.send([(request, 5 * i + 4, 0, 1) for i, request in enumerate(requests)], 15)
    leaving.deliver(wait=True)
    assert leaving.moved == 3 * values  # not the step's 15 tokens x 4 values
    for i, request in enumerate(requests):
        for value in range(values):
            torch.testing.assert_close(request.tensors[value][0], expected[value, 5 * i + 4])
    leaving.close()


def region_request(values: int, rows: int, hidden: int) -> tuple[SharedRows, KeptRows]:
    """A region of a harvest's kind and a request keeping all its rows there, as `Capturer.request` opens it."""
    shared = SharedRows(values, rows, hidden, torch.float32)
    region = open_region(shared.destination(0), torch.float32)
    assert region is not None
    return shared, KeptRows({"values": ["a", "b"]}, [0, 1], [], region=region, first=0, capacity=rows)


def test_kept_rows_are_written_into_a_region_by_the_writer_thread_not_the_engines(monkeypatch):
    values, tokens, hidden, steps = 2, 6, 3, 5
    rows, leaving = leaving_rows(values, tokens, hidden, stand_in_device())
    shared, request = region_request(values, 2 * steps, hidden)
    put, writers = Region.put, []

    def slow_put(self: Region, row: int, rows: torch.Tensor, value: int = 0) -> None:
        writers.append(threading.get_ident())
        time.sleep(0.05)  # a slow disk
        put(self, row, rows, value)

    monkeypatch.setattr(Region, "put", slow_put)
    written = sent_steps(leaving, rows, [request], steps)
    leaving.deliver(wait=True)
    assert not leaving.pending and request.filled == 2 * steps
    assert len(writers) == steps * values and threading.get_ident() not in writers
    torch.testing.assert_close(shared.tensor, torch.cat(written, dim=1))
    leaving.close()
    request.region.close()
    shared.close()


def test_a_write_failing_on_the_writer_thread_is_raised_on_the_engines(monkeypatch):
    values, tokens, hidden = 2, 6, 3
    rows, leaving = leaving_rows(values, tokens, hidden, stand_in_device())
    shared, request = region_request(values, 8, hidden)
    puts = []

    def full_disk(self: Region, row: int, rows: torch.Tensor, value: int = 0) -> None:
        puts.append(row)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Region, "put", full_disk)
    leaving.send([(request, 0, 0, 2)], 2)
    with pytest.raises(OSError, match="No space left"):
        leaving.deliver(wait=True)
    with pytest.raises(OSError, match="No space left"):  # and at every later step: nothing more is written
        leaving.send([(request, 0, 2, 2)], 2)
    assert puts == [0]
    with pytest.raises(OSError, match="No space left"):
        leaving.close()
    assert not leaving.writer.is_alive()
    request.region.close()
    shared.close()


def test_buffers_that_do_not_fit_the_device_are_refused_naming_their_sizes_and_settings():
    sizes = EngineSizes(30, 576, torch.bfloat16, 4096, 256, 256, 3, 30, (), accelerator=True)
    buffers = engine_buffers(sizes)
    device = sum(buffer.nbytes for buffer in buffers.values() if not buffer.pinned)
    check_room(buffers, device)
    with pytest.raises(
        ValueError,
        match=r"capture buffer 0\.\d\d GiB \(capture_values, max_num_batched_tokens\).*"
        r"0\.00 GiB of it is left.*Lower the setting",
    ):
        check_room(buffers, 1000)
    # A tensor-parallel rank after the first keeps no rows: no capture buffers there.
    later_rank = engine_buffers(EngineSizes(30, 576, torch.bfloat16, 4096, 256, 256, 3, 30, (), True, keeps_rows=False))
    assert not [name for name in later_rank if name.startswith("capture")]
