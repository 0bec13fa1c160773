"""A standardized trace sent to where the model is: the model's remote key, and nnsight's dry run of sending it.

The served-values tests (against plain transformers and across engines) are the README's examples sent with
``remote="local"`` (tests/test_readme.py) and nnterp's helpers (tests/test_nnterp.py); here the key, and that
rebuilding a trace imports nothing a second time.
"""

from __future__ import annotations

import json
import typing

import pytest
import reference
import tiny
import torch
from transformers import AutoModelForCausalLM

from nnterp_vllm import StandardizedTransformer, StandardizedVLLM


def test_the_model_key_names_the_class_and_a_local_checkpoint_by_its_absolute_path(monkeypatch):
    path = tiny.checkpoint("llama")
    monkeypatch.chdir(path.parent)
    hf = StandardizedTransformer(path.name)
    class_path, _, checkpoint = hf.to_model_key().partition(":")
    assert class_path == "nnterp_vllm.engines.transformers.StandardizedTransformer"
    assert json.loads(checkpoint) == {"repo_id": str(path), "revision": None, "task": "text-generation"}
    vllm = StandardizedVLLM(path.name)
    assert vllm.to_model_key() == f"nnterp_vllm.engines.vllm.StandardizedVLLM:{path}"
    assert vllm.vllm_entrypoint is None and not hf.dispatched  # no key needs weights or an engine


def test_a_model_rebuilt_from_its_key_serves_the_same_values():
    path = tiny.checkpoint("llama")
    model = StandardizedTransformer(path)
    rebuilt = StandardizedTransformer.from_model_key(model.to_model_key())
    assert type(rebuilt) is StandardizedTransformer
    with rebuilt.trace(reference.PROMPT):
        output = rebuilt.layers[1].layer_output.save()
    truth = reference.run(reference.load(path), output_hidden_states=True).hidden_states[2]
    torch.testing.assert_close(output, truth, atol=1e-5, rtol=1e-5)


def test_a_model_given_loaded_without_a_checkpoint_has_no_key_and_says_why():
    config = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama")).config
    config.name_or_path = ""
    model = StandardizedTransformer(AutoModelForCausalLM.from_config(config), tokenizer=tiny.tokenizer())
    with pytest.raises(ValueError, match="no checkpoint behind it.*checkpoint directory or hub id"):
        model.to_model_key()


def zeroed_last_token(stream: torch.Tensor) -> None:
    """A caller's own function: hidden while the trace is rebuilt, so it travels with the trace by value."""
    stream[:, -1] = 0


def test_a_trace_sent_locally_is_rebuilt_without_importing_anything_twice():
    """The dry run hides the caller's own modules only; the library, vLLM and typing_extensions stay the ones
    loaded (a second typing_extensions would break ``typing`` for the process, a second vLLM refuses to import)."""
    model = StandardizedTransformer(tiny.checkpoint("llama"))
    collect_parameters = typing._collect_parameters  # what an import of typing_extensions replaces
    with model.trace(reference.PROMPT):
        here = model.layers[0].layer_output.save()
    with model.trace(reference.PROMPT, remote="local"):
        zeroed_last_token(model.layers[0].layer_output)
        sent = model.layers[0].layer_output.save()
        probabilities = model.next_token_probs.save()
    assert typing._collect_parameters is collect_parameters
    assert sent[0, -1].abs().max() == 0 and torch.equal(sent[0, :-1], here[0, :-1])
    assert probabilities.shape == (1, model.vocab_size)


def test_a_transformers_trace_is_not_sent_to_a_trace_server_and_says_where_to_send_it():
    model = StandardizedTransformer(tiny.checkpoint("llama"))
    with pytest.raises(ValueError, match=r"serve=: .* runs its traces on vLLM; send the trace from StandardizedVLLM"):
        with model.trace(reference.PROMPT, serve="http://127.0.0.1:1"):
            model.layers[0].layer_output.save()
