"""StandardizedVLLM on vLLM's CPU build, checked against StandardizedTransformer and plain transformers."""

from __future__ import annotations

import nnsight
import pytest
import reference
import tiny
import torch

from nnterp_vllm import StandardizedTransformer, UnsupportedFamily, families
from nnterp_vllm.engines.vllm import StandardizedVLLM

VLLM_FAMILIES = families.known(families.VLLM)
#: fp32 on both engines; the kernels differ (fused add+norm, oneDNN matmuls), so values agree
#: to rounding, which grows through the blocks: 1e-4 relative and absolute covers it with margin.
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}
VALUES = ("layer_input", "attention_output", "mlp_output", "layer_output")


def close(actual, expected, **tolerance):
    torch.testing.assert_close(actual.detach().float(), expected.detach().float(), **(tolerance or TOLERANCE))


def greedy(**kwargs):
    return {"temperature": 0.0, "max_tokens": 1, **kwargs}


@pytest.fixture(scope="module", params=VLLM_FAMILIES)
def engines(request):
    """(model_type, StandardizedVLLM, StandardizedTransformer) on one tiny checkpoint; the engine is shut down after."""
    path = tiny.checkpoint(request.param)
    vllm_model = StandardizedVLLM(path, dtype="float32", dispatch=True)
    yield request.param, vllm_model, StandardizedTransformer(path)
    vllm_model.shutdown()


def read_blocks(model, prompt=reference.PROMPT, **kwargs):
    """Every block's stream values, the final norm and the logits, in one trace."""
    rows = []
    with model.trace(prompt, **kwargs):
        for block in model.layers:
            row = []
            for name in VALUES:
                row.append(getattr(block, name).save())
            rows.append(row)
        final = model.final_norm_output.save()
        logits = model.logits.save()
    return rows, final, logits


def test_values_equal_transformers(engines):
    _, on_vllm, on_hf = engines
    vllm_rows, vllm_final, vllm_logits = read_blocks(on_vllm, **greedy())
    hf_rows, hf_final, hf_logits = read_blocks(on_hf)
    for vllm_row, hf_row in zip(vllm_rows, hf_rows):
        for name, vllm_value, hf_value in zip(VALUES, vllm_row, hf_row):
            assert vllm_value.shape == hf_value.shape, name
            close(vllm_value, hf_value)
    close(vllm_final, hf_final)
    close(vllm_logits[:, -1], hf_logits[:, -1])
    close(vllm_logits, hf_logits)


def read_on_both(engines, names, layers):
    """Values ``names`` of module ``layers[i].<child>`` (``"self_attn.attention_keys"``), saved in one trace on
    each engine: (vLLM's, transformers')."""
    _, on_vllm, on_hf = engines
    results = []
    for model, kwargs in ((on_vllm, greedy()), (on_hf, {})):
        saved = []
        with model.trace(reference.PROMPT, **kwargs):
            for i in layers:
                for name in names:
                    saved.append(model.layers[i].get(name).save())
        results.append(saved)
    return results


def test_attention_interior_equals_transformers(engines):
    names = ("attention_queries", "attention_keys", "attention_values", "attention_premix", "attention_head_outputs")
    for vllm_value, hf_value in zip(*read_on_both(engines, [f"self_attn.{name}" for name in names], [1])):
        close(vllm_value, hf_value)


def served(model, name, layer):
    entry = model.support()[name]
    return entry is None or (isinstance(entry, dict) and layer not in entry)


def test_router_logits_equal_transformers(engines):
    """On a mixture of experts: the router's logits on every sparse block; the fused expert choice refused."""
    _, on_vllm, on_hf = engines
    routed = [i for i in range(on_hf.num_layers) if served(on_hf, "mlp.router_logits", i)]
    if not routed:
        pytest.skip("a dense family: no router")
    assert routed == [i for i in range(on_vllm.num_layers) if served(on_vllm, "mlp.router_logits", i)]
    for vllm_value, hf_value in zip(*read_on_both(engines, ["mlp.router_logits"], routed)):
        assert vllm_value.shape == hf_value.shape and vllm_value.shape[-1] == on_hf.num_experts
        close(vllm_value, hf_value)
    reason = on_vllm.support()["mlp.expert_indices"]
    assert "fused MoE kernel" in (reason if isinstance(reason, str) else reason[routed[0]])


def test_residual_identity_on_vllm(engines):
    _, on_vllm, _ = engines
    rows, _, _ = read_blocks(on_vllm, **greedy())
    for layer_input, attention_output, mlp_output, layer_output in rows:
        close(layer_input + attention_output + mlp_output, layer_output, atol=1e-5, rtol=1e-5)


def test_saved_values_survive_the_rest_of_the_forward(engines):
    """vLLM adds the residual in place inside its fused norm: a read must be a copy, not its buffer."""
    _, on_vllm, on_hf = engines
    expected = reference.run(reference.load(tiny.checkpoint(engines[0])), output_hidden_states=True)
    with on_vllm.trace(reference.PROMPT, **greedy()):
        second = on_vllm.layers[1].layer_input.save()
        third = on_vllm.layers[2].layer_input.save()
    close(second, expected.hidden_states[1])
    close(third, expected.hidden_states[2])


def test_steering_matches_transformers(engines):
    _, on_vllm, on_hf = engines
    vector = torch.randn(on_hf.hidden_size, generator=torch.Generator().manual_seed(3)) * 2
    probabilities = []
    for model, kwargs in ((on_vllm, greedy()), (on_hf, {})):
        with model.trace(reference.PROMPT, **kwargs):
            model.steer([0, 2], vector, factor=1.5, positions=[1, -1])
            probs = model.next_token_probs.save()
        probabilities.append(probs)
    close(probabilities[0], probabilities[1], atol=1e-5, rtol=1e-4)


def test_steered_greedy_generation_matches_transformers(engines):
    _, on_vllm, on_hf = engines
    vector = torch.randn(on_hf.hidden_size, generator=torch.Generator().manual_seed(4)) * 4
    steps = 4
    with on_vllm.generate(reference.PROMPT, max_new_tokens=steps, do_sample=False, ignore_eos=True) as tracer:
        samples = nnsight.save([])
        for _ in tracer.iter[:steps]:
            on_vllm.steer(1, vector)
            samples.append(on_vllm.samples)
    with on_hf.generate(reference.PROMPT, max_new_tokens=steps, do_sample=False, min_new_tokens=steps) as tracer:
        for _ in tracer.iter[:steps]:
            on_hf.steer(1, vector)
        tokens = tracer.result.save()
    assert [int(sample.flatten()[0]) for sample in samples] == tokens[0, -steps:].tolist()


def test_several_invokes_equal_separate_traces(engines):
    _, on_vllm, _ = engines
    prompts = [reference.PROMPT, reference.OTHER_PROMPT]
    alone = []
    for prompt in prompts:
        with on_vllm.trace(prompt, **greedy()):
            output = on_vllm.layers[2].layer_output.save()
        alone.append(output)
    with on_vllm.trace(**greedy()) as tracer:
        with tracer.invoke(prompts[0]):
            first = on_vllm.layers[2].layer_output.save()
        with tracer.invoke(prompts[1]):
            second = on_vllm.layers[2].layer_output.save()
    together = [first, second]
    for single, batched in zip(alone, together):
        close(batched, single, atol=1e-6, rtol=1e-6)


def test_support_has_the_same_rows_on_both_engines(engines):
    _, on_vllm, on_hf = engines
    vllm_table, hf_table = on_vllm.support(), on_hf.support()
    assert set(vllm_table) == set(hf_table)
    assert vllm_table["engine"] == "vllm" and hf_table["engine"] == "transformers"
    assert "fused attention kernel" in vllm_table["self_attn.attention_probabilities"]


def test_the_engine_survives_each_kind_of_bad_input(engines):
    _, on_vllm, _ = engines
    bad = [
        lambda: on_vllm.steer(1, torch.zeros(3)),
        lambda: on_vllm.steer(99, torch.zeros(on_vllm.hidden_size)),
        lambda: on_vllm.layers[1].no_such_value.save(),
        lambda: setattr(on_vllm.layers[1], "layer_output", torch.zeros(2, 2)),
        lambda: on_vllm.layers[1].self_attn.attention_probabilities.save(),
        lambda: on_vllm.layers[99],
    ]
    for attempt in bad:
        with pytest.raises(Exception) as caught:  # noqa: PT011 - the type differs per attempt; the message is checked
            with on_vllm.trace(reference.PROMPT, **greedy()):
                attempt()
        message = str(caught.value)
        assert any(word in message for word in ("shape", "num_layers", "no_such_value", "one prompt", "fused")), message
        with on_vllm.trace(reference.PROMPT, **greedy()):
            logits = on_vllm.logits.save()
        assert torch.isfinite(logits).all()


def test_logit_lens_and_projection_run_unchanged(engines):
    _, on_vllm, on_hf = engines
    close(on_vllm.logit_lens(reference.PROMPT), on_hf.logit_lens(reference.PROMPT), atol=1e-5, rtol=1e-4)


def test_unsupported_type_and_prefix_caching_are_refused(tmp_path):
    with pytest.raises(UnsupportedFamily, match=r"no vLLM family for model_type 'bloom'.*llama"):
        StandardizedVLLM(tiny.checkpoint("bloom"))
    with pytest.raises(ValueError, match="prefix_caching"):
        StandardizedVLLM(tiny.checkpoint("llama"), enable_prefix_caching=True)


def test_smollm2_on_vllm():
    from nnterp_vllm.checkpoints import smollm2

    path = smollm2()
    on_vllm = StandardizedVLLM(path, dtype="float32", dispatch=True, max_model_len=512)
    try:
        prompt = "The Eiffel Tower is in the city of"
        outputs = []
        with on_vllm.trace(prompt, **greedy()):
            for block in on_vllm.layers:
                outputs.append(block.layer_output.save())
            logits = on_vllm.logits.save()
        assert on_vllm.tokenizer.decode(logits[0, -1].argmax()) == " Paris"
        on_hf = StandardizedTransformer(path)
        expected = []
        with on_hf.trace(prompt):
            for block in on_hf.layers:
                expected.append(block.layer_output.save())
        for got, want in zip(outputs, expected):
            close(got, want, atol=1e-3, rtol=1e-3)
    finally:
        on_vllm.shutdown()


def test_nnsight_save_of_a_container_works_on_vllm(engines):
    _, on_vllm, _ = engines
    with on_vllm.trace(reference.PROMPT, **greedy()):
        saved = nnsight.save([on_vllm.layers[0].layer_output[:, -1]])
    assert saved[0].shape == (1, on_vllm.hidden_size)


def test_tensor_parallel_serves_whole_values(monkeypatch):
    """Two CPU ranks: heads and vocabulary are split across them; every value comes back whole and equal."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    path = tiny.checkpoint("llama")
    on_vllm = StandardizedVLLM(path, dtype="float32", tensor_parallel_size=2, dispatch=True)
    on_hf = StandardizedTransformer(path)
    names = ("attention_queries", "attention_keys", "attention_premix", "attention_head_outputs")
    try:
        results = []
        for model, kwargs in ((on_vllm, greedy()), (on_hf, {})):
            saved = []
            with model.trace(reference.PROMPT, **kwargs):
                for name in names:
                    saved.append(getattr(model.layers[1].self_attn, name).save())
                model.steer(1, torch.ones(model.hidden_size), factor=0.5)
                saved.append(model.layers[2].layer_output.save())
                saved.append(model.logits.save())
            results.append(saved)
        for vllm_value, hf_value in zip(*results):
            close(vllm_value, hf_value)
        with on_vllm.trace(reference.PROMPT, **greedy()):
            attention = on_vllm.layers[0].self_attn
            attention.attention_values = torch.zeros_like(attention.attention_values)
            silenced = on_vllm.layers[0].attention_output.save()
        assert torch.count_nonzero(silenced) == 0
    finally:
        on_vllm.shutdown()
