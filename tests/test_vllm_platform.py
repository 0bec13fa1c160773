"""nnsight's VLLM on this machine's vLLM platform (CPU build here), against plain transformers.

One in-process engine for the module (VLLM_ENABLE_V1_MULTIPROCESSING=0), over a tiny random llama.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tiny
import torch

from nnterp_vllm.engines.engine_defaults import CPU_KV_CACHE_BYTES, engine_kwargs
from nnterp_vllm.engines.lifecycle import shutdown
from nnterp_vllm.engines.nnsight_vllm import PlatformVLLM
from nnterp_vllm.engines.vllm_platform import is_cpu_platform
from nnterp_vllm.engines.worker_classes import worker_class

ATOL = 1e-4
PROMPTS = ["Hello world", "The cat sat on the mat."]


@pytest.fixture(scope="module")
def path() -> Path:
    return tiny.checkpoint("llama")


@pytest.fixture(scope="module")
def hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(path: Path):
    vllm_model = PlatformVLLM(str(path), dispatch=True, dtype="float32")
    yield vllm_model
    shutdown(vllm_model)


def ids(model, text: str) -> list[int]:
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]


def hf_forward(hf, token_ids: list[int]):
    with torch.no_grad():
        return hf(torch.tensor([token_ids]), output_hidden_states=True)


def test_platform_detection():
    from vllm.platforms import current_platform

    assert is_cpu_platform() == current_platform.is_cpu()


def test_engine_kwargs():
    assert engine_kwargs(kv_cache_memory_bytes=1) == {"kv_cache_memory_bytes": 1}
    kwargs = engine_kwargs(dtype="float32")
    if is_cpu_platform():
        assert kwargs["dtype"] == "float32"
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            assert kwargs["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES
        with pytest.raises(TypeError):
            engine_kwargs(worker_cls="x.Y")
    else:
        assert kwargs == {"dtype": "float32"}


def test_worker_classes_resolve_by_dotted_path():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    from nnterp_vllm.engines.steered import runners

    worker = resolve_obj_by_qualname(worker_class())
    assert issubclass(worker, CPUWorker)
    assert issubclass(runners.EngineCPUModelRunner, CPUModelRunner)
    for name in ("collect_nnsight", "nnsight_request_count", "nnsight_register", "nnsight_clear_registered"):
        assert callable(getattr(worker, name))


def test_trace_matches_transformers(model, hf):
    token_ids = ids(model, PROMPTS[0])
    with model.trace(token_ids, temperature=0.0, max_tokens=1):
        hidden, residual = model.model.layers[1].output
        block = (hidden + residual).save()
        logits = model.logits.save()

    reference = hf_forward(hf, token_ids)
    assert block.shape == (len(token_ids), hf.config.hidden_size)
    torch.testing.assert_close(block, reference.hidden_states[2][0], atol=ATOL, rtol=0)
    # vLLM computes logits for each request's last position only.
    assert logits.shape == (1, hf.config.vocab_size)
    torch.testing.assert_close(logits[0], reference.logits[0, -1], atol=ATOL, rtol=0)


def test_invokes_each_get_their_own_tokens(model, hf):
    token_ids = [ids(model, text) for text in PROMPTS]
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        with tracer.invoke(token_ids[0]):
            hidden, residual = model.model.layers[1].output
            first = (hidden + residual).save()
            first_logits = model.logits.save()
        with tracer.invoke(token_ids[1]):
            hidden, residual = model.model.layers[1].output
            second = (hidden + residual).save()
            second_logits = model.logits.save()

    for block, logits, prompt in zip((first, second), (first_logits, second_logits), token_ids):
        reference = hf_forward(hf, prompt)
        assert block.shape == (len(prompt), hf.config.hidden_size)
        torch.testing.assert_close(block, reference.hidden_states[2][0], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[0], reference.logits[0, -1], atol=ATOL, rtol=0)


def test_greedy_samples_match_transformers(model, hf):
    token_ids = ids(model, PROMPTS[1])
    with model.trace(token_ids, temperature=0.0, max_tokens=3, ignore_eos=True) as tracer:
        samples = list().save()
        for _ in tracer.iter[:3]:
            samples.append(model.samples.clone())

    expected, context = [], list(token_ids)
    for _ in range(3):
        with torch.no_grad():
            next_id = int(hf(torch.tensor([context])).logits[0, -1].argmax())
        expected.append(next_id)
        context.append(next_id)

    assert [int(sample.reshape(-1)[0]) for sample in samples] == expected
    outputs = model.generate({"prompt_token_ids": token_ids}, temperature=0.0, max_tokens=3, ignore_eos=True)
    assert list(outputs[0].outputs[0].token_ids) == expected


def test_error_in_trace_surfaces_and_engine_survives(model):
    token_ids = ids(model, PROMPTS[0])
    with pytest.raises(Exception, match="boom"):
        with model.trace(token_ids, temperature=0.0, max_tokens=3):
            model.model.layers[0].output[0].save()
            raise ValueError("boom")
    with pytest.raises(Exception, match="out of bounds"):
        with model.trace(token_ids, temperature=0.0, max_tokens=3):
            model.model.layers[1].output[0][1000].save()

    with model.trace(token_ids, temperature=0.0, max_tokens=1):
        logits = model.logits.save()
    assert logits.shape[0] == 1 and torch.isfinite(logits).all()
