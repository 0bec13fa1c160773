"""An engine built to steer the blocks' outputs only (``steering_values=["layer_output"]``): the steering operation
runs once per block, steers there as a transformers forward hook does, and refuses what needs the other places."""

from __future__ import annotations

import pytest
import tiny
import torch
from transformers import AutoModelForCausalLM
from vllm import SamplingParams

from nnterp_vllm import Ablate, Patch, SteeredVLLM, Steering

PROMPT = "The quick brown fox"
STEPS = 8


@pytest.fixture(scope="module")
def engine():
    model = SteeredVLLM(tiny.checkpoint("llama"), dtype="float32", max_model_len=128, steering_values=["layer_output"])
    yield model
    model.shutdown()


def hooked_greedy(specs: list[Steering]) -> list[int]:
    """Greedy tokens of the transformers model with each spec's ``factor * vector`` added to its block's output by a
    forward hook."""
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), torch_dtype=torch.float32)
    for spec in specs:

        def add(module, args, output, spec=spec):
            hidden = output[0] if isinstance(output, tuple) else output
            steered = hidden + spec.factor * torch.as_tensor(spec.vector, dtype=hidden.dtype)
            return (steered, *output[1:]) if isinstance(output, tuple) else steered

        for layer in spec.layers:
            model.model.layers[layer].register_forward_hook(add)
    ids = tiny.tokenizer()(PROMPT, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS)
    return out[0, ids.shape[1] :].tolist()


def test_the_operation_runs_once_per_block_and_adds_as_a_transformers_hook(engine):
    (stats,) = engine.steering_stats()
    assert stats["operations"] == engine.num_layers
    generator = torch.Generator().manual_seed(3)
    specs = [Steering(layer, torch.randn(engine.hidden_size, generator=generator) * 3, factor=2.0) for layer in (0, 2)]
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    steered, plain = engine.generate([PROMPT, PROMPT], params, [specs, []], use_tqdm=False)
    assert list(steered.outputs[0].token_ids) == hooked_greedy(specs)
    assert list(plain.outputs[0].token_ids) == hooked_greedy([]) != hooked_greedy(specs)


def test_specs_needing_the_other_places_are_refused_naming_the_setting(engine):
    direction = torch.ones(engine.hidden_size)
    refused = [
        (Ablate(direction), r"layers='all' .* the engine is built to steer layer_output only \(steering_values\)"),
        (
            Patch(direction, layers=1, positions=[0], value="mlp_output"),
            r"value='mlp_output' is not served on this model: the engine is built to steer layer_output only",
        ),
    ]
    for spec, message in refused:
        with pytest.raises(ValueError, match=message):
            engine.generate(PROMPT, SamplingParams(max_tokens=1), spec, use_tqdm=False)
