"""Real weights: the prepared SmolLM2-135M checkpoint, against plain transformers, and as users load it on vLLM."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nnterp_vllm import StandardizedTransformer, StandardizedVLLM
from nnterp_vllm.checkpoints import smollm2

PROMPT = "The Eiffel Tower is in the city of"


@pytest.fixture(scope="module")
def path():
    return smollm2()


@pytest.fixture(scope="module")
def model(path):
    return StandardizedTransformer(path)


@pytest.fixture(scope="module")
def expected(path):
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    inputs = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt")
    with torch.no_grad():
        return hf(**inputs, output_hidden_states=True)


def test_top1_is_paris(model):
    with model.trace(PROMPT):
        logits = model.logits.save()
        probs = model.next_token_probs.save()
    assert model.tokenizer.decode(logits[0, -1].argmax()) == " Paris"
    assert probs[0].max() > 0.5


def test_values_equal_plain_transformers(model, expected):
    outputs = []
    with model.trace(PROMPT):
        for block in model.layers:
            outputs.append(block.layer_output.save())
        final = model.final_norm_output.save()
        logits = model.logits.save()
    for i, output in enumerate(outputs[:-1]):
        torch.testing.assert_close(output, expected.hidden_states[i + 1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, expected.hidden_states[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=1e-4)
    assert model.num_layers == 30 and model.hidden_size == 576 and model.num_kv_heads == 3


def test_loads_on_vllm_without_any_kv_arithmetic(path):
    on_vllm = StandardizedVLLM(path, dtype="float32")
    try:
        with on_vllm.trace("The Eiffel Tower is in the city of"):
            logits = on_vllm.logits.save()
        assert on_vllm.tokenizer.decode(logits[0, -1].argmax()) == " Paris"
        config = json.loads((path / "config.json").read_text())
        assert on_vllm.vllm_entrypoint.llm_engine.model_config.max_model_len == config["max_position_embeddings"]
    finally:
        on_vllm.shutdown()
