"""The same experiments on both engines: written once against the public API, run unchanged on each.

Every ``experiment_*`` function below is spelled the way README.md teaches for transformers. The
tests run it on StandardizedTransformer and on StandardizedVLLM over the same checkpoint and compare
the results with each other and with transformers' own outputs (``output_hidden_states``,
``output_attentions``, ``generate``, forward hooks). The attention pattern and a mixture of experts'
choice, which vLLM's kernels never materialize, are rebuilt there when read: the experiments read them
alike on both engines, at generated steps too; what vLLM refuses (writing them) is refused with
`UnavailableValue`, and the test says so.
"""

from __future__ import annotations

from types import SimpleNamespace

import nnsight
import pytest
import reference
import tiny
import torch

from nnterp_vllm import StandardizedTransformer, StandardizedVLLM, UnavailableValue
from nnterp_vllm.checkpoints import smollm2

#: Tiny checkpoints of each stream layout and block kind, and the real SmolLM2.
CHECKPOINTS = ("llama", "gpt2", "gemma2", "mixtral", "smollm2")
BLOCK_VALUES = ("layer_input", "attention_output", "mlp_output", "layer_output")
ATTENTION_VALUES = (
    "attention_queries",
    "attention_keys",
    "attention_values",
    "attention_premix",
    "attention_head_outputs",
    "attention_output",
)
PROMPT = reference.PROMPT
PROMPTS = (reference.PROMPT, reference.OTHER_PROMPT, "Paris is the capital of")


# -- the experiments, written once ---------------------------------------------


def experiment_read_every_block_value(model, prompt=PROMPT):
    rows = []
    with model.trace(prompt):
        for block in model.layers:
            rows.append({name: getattr(block, name).save() for name in BLOCK_VALUES})
        final = model.final_norm_output.save()
        logits = model.logits.save()
    return rows, final, logits


def experiment_read_attention_values(model, prompt=PROMPT):
    with model.trace(prompt):
        heads = [{name: getattr(block.self_attn, name).save() for name in ATTENTION_VALUES} for block in model.layers]
    return heads


def experiment_collect_into_containers(model, prompt=PROMPT):
    before_the_trace = []
    by_layer = {}
    with model.trace(prompt):
        made_inside = [block.layer_input.save() for block in model.layers]
    with model.trace(prompt):
        for index, block in enumerate(model.layers):
            output = block.layer_output.save()
            before_the_trace.append(output)
            by_layer[index] = output
        pair = (model.final_norm_output.save(), model.logits.save())
    return made_inside, before_the_trace, by_layer, pair


def experiment_write_in_place(model, prompt=PROMPT):
    with model.trace(prompt):
        model.layers[0].layer_output[:, -1] *= 0.5
        probs = model.next_token_probs.save()
    return probs


def experiment_write_by_assignment(model, prompt=PROMPT):
    with model.trace(prompt):
        stream = model.layers[1].layer_input.save()
        attention = model.layers[1].attention_output.save()
        mlp = model.layers[1].mlp_output
        doubled = (mlp * 2).save()
        model.layers[1].mlp_output = doubled
        output = model.layers[1].layer_output.save()
        probs = model.next_token_probs.save()
    return stream, attention, doubled, output, probs


def experiment_steer(model, vector, prompt=PROMPT):
    results = {}
    with model.trace(prompt):
        model.steer(layers=1, vector=vector, factor=2.0)
        results["one layer"] = model.next_token_probs.save()
    with model.trace(prompt):
        model.steer(layers=[0, 2], vector=vector)
        results["several layers"] = model.next_token_probs.save()
    with model.trace(prompt):
        model.steer(layers=1, vector=vector, factor=-1.5, positions=[0, -1])
        results["positions"] = model.layers[1].layer_output.save()
    return results


def experiment_skip_layers(model, prompt=PROMPT):
    with model.trace(prompt):
        skipped_in = model.layers[1].layer_input.save()
        model.skip_layers(1, 2)
        skipped_out = model.layers[2].layer_output.save()
        logits = model.logits.save()
    return skipped_in, skipped_out, logits


def experiment_project_on_vocab(model, prompt=PROMPT):
    with model.trace(prompt):
        lens = model.project_on_vocab(model.layers[1].layer_output).save()
        logits = model.logits.save()
    return lens, logits


def experiment_several_invokes(model, prompts=PROMPTS):
    last_positions = []
    with model.trace() as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                last_positions.append(model.layers[1].layer_output[:, -1].save())
    return last_positions


def experiment_steered_generation(model, vector, prompt=PROMPT, steps=8):
    tokens = []
    with model.generate(prompt, max_new_tokens=steps, do_sample=False, min_new_tokens=steps) as tracer:
        for _ in tracer.iter[:steps]:
            if vector is not None:
                model.steer(layers=1, vector=vector)
            tokens.append(model.next_token_probs.argmax(dim=-1).save())
    return torch.cat(tokens)


def experiment_nnterp_aliases(model, prompt=PROMPT):
    with model.trace(prompt):
        layer_one = model.layers_output[1].save()
        stream = model.layers_input[2]
        attention = model.attentions_output[2].save()
        mlp = model.mlps_output[2].save()
        model.layers_output[2] = stream + attention + mlp
        logits = model.logits.save()
    return layer_one, attention, mlp, logits


def experiment_read_pattern(model, prompt=PROMPT):
    with model.trace(prompt):
        pattern = model.layers[0].self_attn.attention_probabilities.save()
    return pattern


def experiment_read_pattern_and_expert_choice(model, prompt=PROMPT):
    """Every block's scores and pattern, and, on a mixture of experts, its router logits and expert choice."""
    routed = [i for i in range(model.num_layers) if model.support()["mlp.expert_indices"] is None]
    with model.trace(prompt):
        rows = []
        for i, block in enumerate(model.layers):
            row = {
                "scores": block.self_attn.attention_scores.save(),
                "pattern": block.self_attn.attention_probabilities.save(),
            }
            if i in routed:
                row["router"] = block.mlp.router_logits.save()
                row["experts"] = block.mlp.expert_indices.save()
                row["weights"] = block.mlp.expert_weights.save()
            rows.append(row)
    return rows


def experiment_read_pattern_while_generating(model, prompt=PROMPT, steps=3):
    """Every block's scores and pattern at each step of a greedy generation: the prompt's rows, then one row
    per generated token over its whole context."""
    with model.generate(prompt, max_new_tokens=steps, do_sample=False) as tracer:
        read = nnsight.save([])
        for _ in tracer.iter[:steps]:
            read.append(
                [
                    (block.self_attn.attention_scores.save(), block.self_attn.attention_probabilities.save())
                    for block in model.layers
                ]
            )
    return read


def experiment_read_pattern_at_one_later_step(model, prompt=PROMPT, step=2):
    """The last block's pattern at one generated step only, nothing read before it."""
    with model.generate(prompt, max_new_tokens=step + 1, do_sample=False) as tracer:
        for _ in tracer.iter[step]:
            pattern = model.layers[-1].self_attn.attention_probabilities.save()
    return pattern


def experiment_write_pattern(model, prompt=PROMPT):
    """The first block's pattern replaced by a uniform causal one."""
    with model.trace(prompt):
        pattern = model.layers[0].self_attn.attention_probabilities
        seq = pattern.shape[-1]
        uniform = torch.tril(torch.ones(seq, seq)) / torch.arange(1, seq + 1).unsqueeze(1)
        model.layers[0].self_attn.attention_probabilities = uniform.expand_as(pattern).to(pattern.dtype)
        logits = model.logits.save()
    return logits


def experiment_reroute(model, prompt=PROMPT):
    with model.trace(prompt):
        model.layers[0].mlp.expert_indices = (model.layers[0].mlp.expert_indices + 1) % model.num_experts
        logits = model.logits.save()
    return logits


# -- engines --------------------------------------------------------------------


def close(actual, expected, tolerance):
    torch.testing.assert_close(actual.detach().float(), expected.detach().float(), **tolerance)


@pytest.fixture(scope="module", params=CHECKPOINTS)
def engines(request):
    """Both engines on one checkpoint (the vLLM engine shut down after the module's tests on it)."""
    real = request.param == "smollm2"
    path = smollm2() if real else tiny.checkpoint(request.param)
    on_hf = StandardizedTransformer(path)
    on_vllm = StandardizedVLLM(path, dtype="float32", **({"max_model_len": 512} if real else {}))
    # fp32 on both; the kernels differ (fused add+norm, oneDNN matmuls), so values agree to rounding,
    # which grows through SmolLM2's 30 blocks.
    tolerance = {"atol": 4e-3, "rtol": 2e-3} if real else {"atol": 1e-4, "rtol": 1e-4}
    vector = torch.randn(on_hf.hidden_size, generator=torch.Generator().manual_seed(7)) * (8 if real else 2)
    both = SimpleNamespace(name=request.param, path=path, hf=on_hf, vllm=on_vllm, tolerance=tolerance, vector=vector)
    yield both
    both.vllm.shutdown()


def on_both(engines, experiment, *args, **kwargs):
    """``experiment`` run unchanged on each engine: (transformers' result, vLLM's)."""
    return experiment(engines.hf, *args, **kwargs), experiment(engines.vllm, *args, **kwargs)


def served(model, name):
    return model.support()[name] is None


def plain(engines):
    """The checkpoint as a plain transformers model: the independent ground truth."""
    return reference.load(engines.path)


def encoded(engines, prompt=PROMPT):
    return dict(engines.hf.tokenizer(prompt, return_tensors="pt"))


# -- the tests ------------------------------------------------------------------


def test_every_block_value_equals_transformers(engines):
    (hf_rows, hf_final, hf_logits), (vllm_rows, vllm_final, vllm_logits) = on_both(
        engines, experiment_read_every_block_value
    )
    with torch.no_grad():
        truth = plain(engines)(**encoded(engines), output_hidden_states=True)
    assert len(hf_rows) == len(vllm_rows) == engines.hf.num_layers
    for index, (hf_row, vllm_row) in enumerate(zip(hf_rows, vllm_rows)):
        for name in BLOCK_VALUES:
            assert hf_row[name].shape == vllm_row[name].shape, name
            close(vllm_row[name], hf_row[name], engines.tolerance)
        close(hf_row["layer_input"], truth.hidden_states[index], engines.tolerance)
        identity = hf_row["layer_input"] + hf_row["attention_output"] + hf_row["mlp_output"]
        close(identity, hf_row["layer_output"], engines.tolerance)
    close(hf_final, truth.hidden_states[-1], engines.tolerance)
    close(vllm_final, hf_final, engines.tolerance)
    close(hf_logits, truth.logits, engines.tolerance)
    close(vllm_logits, hf_logits, engines.tolerance)


def test_attention_values_equal_on_both_engines(engines):
    hf_heads, vllm_heads = on_both(engines, experiment_read_attention_values)
    for hf_block, vllm_block in zip(hf_heads, vllm_heads):
        for name in ATTENTION_VALUES:
            close(vllm_block[name], hf_block[name], engines.tolerance)
        summed = hf_block["attention_head_outputs"].sum(dim=2)
        assert summed.shape == hf_block["attention_output"].shape


def by_expert(indices, weights):
    """A token's chosen experts and their weights, ordered by expert (the engines may list them in other orders)."""
    order = indices.argsort(dim=-1)
    return indices.gather(-1, order), weights.gather(-1, order)


def test_the_pattern_and_the_expert_choice_equal_on_both_engines(engines):
    """vLLM rebuilds both from what its kernels receive; transformers materializes them; its own
    ``output_attentions`` is the ground truth of the pattern."""
    hf_rows, vllm_rows = on_both(engines, experiment_read_pattern_and_expert_choice)
    with torch.no_grad():
        truth = reference.load(engines.path)(**encoded(engines), output_attentions=True)
    for layer, (hf_row, vllm_row) in enumerate(zip(hf_rows, vllm_rows)):
        assert vllm_row.keys() == hf_row.keys()
        close(hf_row["pattern"], truth.attentions[layer], engines.tolerance)
        close(vllm_row["pattern"], hf_row["pattern"], engines.tolerance)
        close(vllm_row["scores"], hf_row["scores"], engines.tolerance)
        close(vllm_row["pattern"].sum(-1), torch.ones(vllm_row["pattern"].shape[:-1]), engines.tolerance)
        if "experts" in hf_row:
            close(vllm_row["router"], hf_row["router"], engines.tolerance)
            hf_experts, hf_weights = by_expert(hf_row["experts"], hf_row["weights"])
            vllm_experts, vllm_weights = by_expert(vllm_row["experts"], vllm_row["weights"])
            assert torch.equal(vllm_experts, hf_experts)
            close(vllm_weights, hf_weights, engines.tolerance)
    if engines.name == "mixtral":
        assert any("experts" in row for row in vllm_rows), "mixtral's expert choice was not read"


def test_the_pattern_at_every_generated_step_equals_transformers(engines):
    """A generated token's row over its context: the earlier keys read back from vLLM's KV cache. On gemma2's
    sliding-window blocks (a window of 16, shorter than the context) the row spans the window's keys, as
    transformers' cache hands them. Transformers' own ``generate(output_attentions=True)`` is the ground truth."""
    if not served(engines.vllm, "self_attn.attention_probabilities"):
        pytest.skip(engines.vllm.support()["self_attn.attention_probabilities"])
    hf_steps, vllm_steps = on_both(engines, experiment_read_pattern_while_generating)
    with torch.no_grad():
        truth = plain(engines).generate(
            **encoded(engines), max_new_tokens=3, do_sample=False, output_attentions=True, return_dict_in_generate=True
        )
    length = encoded(engines)["input_ids"].shape[1]
    for step, (hf_blocks, vllm_blocks) in enumerate(zip(hf_steps, vllm_steps)):
        for layer, ((hf_scores, hf_pattern), (vllm_scores, vllm_pattern)) in enumerate(zip(hf_blocks, vllm_blocks)):
            assert vllm_pattern.shape[-2] == (length if step == 0 else 1)
            close(hf_pattern, truth.attentions[step][layer], engines.tolerance)
            close(vllm_pattern, hf_pattern, engines.tolerance)
            close(vllm_scores, hf_scores, engines.tolerance)
    later = on_both(engines, experiment_read_pattern_at_one_later_step)
    close(later[1], later[0], engines.tolerance)
    close(later[1], truth.attentions[2][-1], engines.tolerance)


def test_a_cache_without_plain_keys_serves_the_prompts_rows_and_says_why_at_later_steps(engines):
    """An fp8 KV cache holds no keys to read back: the prompt's rows are served (from the kernel's own inputs)
    and a later step is refused with the reason; the engine serves on."""
    if engines.name != "llama":
        pytest.skip("the KV cache's dtype is the engine's, not a family's: checked once, on llama")
    # One in-process engine at a time: the module's is shut down first and built afresh after.
    engines.vllm.shutdown()
    quantized = StandardizedVLLM(engines.path, dtype="float32", kv_cache_dtype="fp8")
    try:
        try:
            prompt_rows = experiment_read_pattern(quantized)
        except NotImplementedError as error:  # vLLM's CPU kernels store fp8 caches only with AVX-512 or AMX
            pytest.skip(str(error))
        close(prompt_rows, experiment_read_pattern(engines.hf), engines.tolerance)
        with pytest.raises(UnavailableValue, match="at this step: .*KV cache is stored as fp8"):
            experiment_read_pattern_at_one_later_step(quantized)
        assert torch.isfinite(experiment_read_pattern(quantized)).all()
    finally:
        quantized.shutdown()
        engines.vllm = StandardizedVLLM(engines.path, dtype="float32")


def test_writing_the_pattern_or_the_experts_is_refused_on_vllm_before_it_runs(engines):
    """Transformers takes both writes; vLLM refuses them before any request reaches the engine (no traceback
    from inside it), with the reason, and serves the next trace."""
    experiments = [experiment_write_pattern]
    if served(engines.hf, "mlp.expert_indices"):
        experiments.append(experiment_reroute)
    for experiment in experiments:
        assert torch.isfinite(experiment(engines.hf)).all()
        with pytest.raises(UnavailableValue, match="cannot be written on vLLM") as caught:
            experiment(engines.vllm)
        assert not getattr(caught.value, "__notes__", None), "refused inside the engine, not before it ran"
    assert torch.isfinite(experiment_read_pattern(engines.vllm)).all()  # the engine serves on


def test_containers_of_saved_values_come_back_filled(engines):
    hf_result, vllm_result = on_both(engines, experiment_collect_into_containers)
    for hf_part, vllm_part in zip(hf_result, vllm_result):
        assert type(hf_part) is type(vllm_part) and len(hf_part) == len(vllm_part)
    hf_inside, hf_before, hf_by_layer, hf_pair = hf_result
    vllm_inside, vllm_before, vllm_by_layer, vllm_pair = vllm_result
    assert sorted(vllm_by_layer) == list(range(engines.hf.num_layers))
    for hf_value, vllm_value in zip([*hf_inside, *hf_before, *hf_pair], [*vllm_inside, *vllm_before, *vllm_pair]):
        close(vllm_value, hf_value, engines.tolerance)
    for index, value in vllm_by_layer.items():
        close(value, vllm_before[index], {"atol": 0, "rtol": 0})


def test_an_in_place_write_equals_a_hooked_forward(engines):
    hf_probs, vllm_probs = on_both(engines, experiment_write_in_place)
    close(vllm_probs, hf_probs, engines.tolerance)
    model = plain(engines)

    def halve_last(module, args, output):
        hidden = (output[0] if isinstance(output, tuple) else output).clone()
        hidden[:, -1] *= 0.5
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = reference.blocks(model)[0].register_forward_hook(halve_last)
    try:
        with torch.no_grad():
            logits = model(**encoded(engines)).logits
    finally:
        handle.remove()
    close(hf_probs, torch.softmax(logits[:, -1].float(), dim=-1), engines.tolerance)


def test_a_write_by_assignment_reaches_the_residual_stream_on_both_engines(engines):
    hf_result, vllm_result = on_both(engines, experiment_write_by_assignment)
    for hf_value, vllm_value in zip(hf_result, vllm_result):
        close(vllm_value, hf_value, engines.tolerance)
    for stream, attention, doubled, output, _ in (hf_result, vllm_result):
        close(stream + attention + doubled, output, engines.tolerance)


def test_steer_equals_on_both_engines_and_adds_the_vector(engines):
    hf_results, vllm_results = on_both(engines, experiment_steer, engines.vector)
    for case in hf_results:
        close(vllm_results[case], hf_results[case], engines.tolerance)
    with engines.hf.trace(PROMPT):
        unsteered = engines.hf.layers[1].layer_output.save()
    expected = unsteered.clone()
    expected[:, [0, -1]] -= 1.5 * engines.vector
    close(hf_results["positions"], expected, engines.tolerance)


def test_skip_layers_hands_the_input_on_on_both_engines(engines):
    (hf_in, hf_out, hf_logits), (vllm_in, vllm_out, vllm_logits) = on_both(engines, experiment_skip_layers)
    close(hf_out, hf_in, {"atol": 1e-6, "rtol": 1e-6})
    close(vllm_out, vllm_in, {"atol": 1e-6, "rtol": 1e-6})
    close(vllm_logits, hf_logits, engines.tolerance)


def test_logit_lens_projection_and_closest_tokens_equal(engines):
    close(engines.vllm.logit_lens(PROMPT), engines.hf.logit_lens(PROMPT), engines.tolerance)
    (hf_lens, hf_logits), (vllm_lens, _) = on_both(engines, experiment_project_on_vocab)
    close(vllm_lens, hf_lens, engines.tolerance)
    last = engines.hf.logit_lens(PROMPT)[:, -1]
    close(last, torch.softmax(hf_logits[:, -1].float(), dim=-1), engines.tolerance)
    hf_tokens, vllm_tokens = on_both(engines, lambda model: model.get_topk_closest_tokens(engines.vector, k=5))
    assert [token for token, _ in hf_tokens[0]] == [token for token, _ in vllm_tokens[0]]


def test_several_invokes_equal_on_both_engines_and_alone(engines):
    hf_last, vllm_last = on_both(engines, experiment_several_invokes)
    assert len(hf_last) == len(vllm_last) == len(PROMPTS)
    for prompt, hf_value, vllm_value in zip(PROMPTS, hf_last, vllm_last):
        close(vllm_value, hf_value, engines.tolerance)
        alone = experiment_several_invokes(engines.vllm, [prompt])[0]
        close(vllm_value, alone, {"atol": 1e-6, "rtol": 1e-6})


def test_greedy_generation_equal_with_and_without_steering(engines):
    steps = 16 if engines.name == "smollm2" else 8
    for vector in (None, engines.vector):
        hf_tokens, vllm_tokens = on_both(engines, experiment_steered_generation, vector, steps=steps)
        assert hf_tokens.tolist() == vllm_tokens.tolist(), "steered" if vector is not None else "unsteered"
        if vector is None:
            ids = encoded(engines)["input_ids"]
            with torch.no_grad():
                generated = plain(engines).generate(
                    ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0
                )
            assert hf_tokens.tolist() == generated[0, ids.shape[1] :].tolist()


def test_nnterp_aliases_read_and_write_on_both_engines(engines):
    hf_result, vllm_result = on_both(engines, experiment_nnterp_aliases)
    for hf_value, vllm_value in zip(hf_result, vllm_result):
        close(vllm_value, hf_value, engines.tolerance)
    rows, _, logits = experiment_read_every_block_value(engines.hf)
    close(hf_result[0], rows[1]["layer_output"], {"atol": 0, "rtol": 0})
    close(hf_result[3], logits, engines.tolerance)  # the residual identity, written back, changes nothing


def test_next_token_probs_equal_and_sum_to_one(engines):
    def experiment(model):
        with model.trace(PROMPT):
            probs = model.next_token_probs.save()
        return probs

    hf_probs, vllm_probs = on_both(engines, experiment)
    assert hf_probs.shape == vllm_probs.shape == (1, engines.hf.vocab_size)
    close(hf_probs.sum(-1), torch.ones(1), {"atol": 1e-5, "rtol": 1e-5})
    close(vllm_probs, hf_probs, engines.tolerance)


def bad_steer_size(model):
    model.steer(layers=1, vector=torch.zeros(7))


def bad_steer_layer(model):
    model.steer(layers=model.num_layers, vector=torch.zeros(model.hidden_size))


def bad_steer_position(model):
    model.steer(layers=1, vector=torch.zeros(model.hidden_size), positions=[0, 100])


def bad_layer_index(model):
    model.layers[model.num_layers].layer_output.save()


def bad_layer_type(model):
    model.layers[1.5].layer_output.save()


def bad_write_shape(model):
    model.layers[1].layer_output = torch.zeros(1, 2, model.hidden_size)


def dense_router(model):
    model.layers[0].mlp.router_logits.save()


def no_such_value(model):
    model.layers[0].no_such_value.save()


def out_of_order(model):
    model.layers[2].layer_output.save()
    model.layers[1].layer_output.save()


ERRORS = {
    bad_steer_size: ValueError,
    bad_steer_layer: ValueError,
    bad_steer_position: ValueError,
    bad_layer_index: IndexError,
    bad_layer_type: TypeError,
    bad_write_shape: ValueError,
    dense_router: UnavailableValue,
    no_such_value: AttributeError,
    out_of_order: Exception,
}


def raised_in_a_trace(model, body):
    """The error ``body`` raises inside a trace, after which the model serves the next trace."""
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the class is compared between engines
        with model.trace(PROMPT):
            body(model)
            model.logits.save()
    with model.trace(PROMPT):
        logits = model.logits.save()
    assert torch.isfinite(logits).all()
    return caught.value


def test_each_error_in_a_trace_reaches_the_user_alike_and_the_engine_serves_on(engines):
    if engines.name != "llama":
        pytest.skip("the error paths are the engines', not a family's: checked once, on llama")
    for body, kind in ERRORS.items():
        on_hf, on_vllm = (raised_in_a_trace(model, body) for model in (engines.hf, engines.vllm))
        assert isinstance(on_hf, kind), (body.__name__, on_hf)
        assert type(on_vllm) is type(on_hf), (body.__name__, on_hf, on_vllm)
        if body is not out_of_order:  # nnsight words the dangling read per engine; both name the location
            assert str(on_vllm) == str(on_hf), body.__name__
        else:
            assert "layers.1" in str(on_vllm) and "layers.1" in str(on_hf)
