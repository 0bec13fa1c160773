"""nnterp's spellings and research helpers, on both engines, against plain transformers with hooks.

Each experiment is written once, the way an nnterp notebook spells it, and runs on
StandardizedTransformer and StandardizedVLLM over the same tiny checkpoint; the results are compared
with each other and with the plain transformers model edited by forward hooks (the independent ground
truth). nnterp's own test suite runs in tests/test_nnterp_suite.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import reference
import tiny
import torch

from nnterp_vllm import StandardizedTransformer, StandardizedVLLM, UnavailableValue, nnterp_options
from nnterp_vllm.display import plot_topk_tokens, prompts_to_df
from nnterp_vllm.interventions import (
    TargetPrompt,
    TargetPromptBatch,
    logit_lens,
    patch_object_attn_lens,
    patchscope_generate,
    patchscope_lens,
)
from nnterp_vllm.nnsight_utils import (
    ModuleAccessor,
    collect_token_activations_batched,
    compute_next_token_probs,
    get_layer_output,
    get_token_activations,
)
from nnterp_vllm.prompt_utils import Prompt, get_first_tokens, run_prompts
from nnterp_vllm.rename_utils import RenameConfig

PROMPT = reference.PROMPT
#: Two prompts of one length (the byte-level tokenizer: one token a character), so a transformers batch needs
#: no padding and each row equals its prompt alone.
PAIR = ("Hello, world!", "Goodbye, all!")
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


def close(actual, expected, tolerance=TOLERANCE):
    torch.testing.assert_close(actual.detach().float(), expected.detach().float(), **tolerance)


@pytest.fixture(scope="module")
def engines():
    """A tiny llama on both engines, and as a plain transformers model (the vLLM engine shut down after)."""
    path = tiny.checkpoint("llama")
    on_vllm = StandardizedVLLM(path, dtype="float32")
    vector = torch.randn(128, generator=torch.Generator().manual_seed(3)) * 2
    yield SimpleNamespace(
        path=path, hf=StandardizedTransformer(path), vllm=on_vllm, plain=reference.load(path), vector=vector
    )
    on_vllm.shutdown()


def on_both(engines, experiment, *args):
    return experiment(engines.hf, *args), experiment(engines.vllm, *args)


def encoded(prompt):
    return reference.encode(prompt)


def plain_logits(model, prompt, hooks=()):
    """The plain model's logits on ``prompt`` with ``(module, hook, pre)`` hooks in place (kwargs hooks)."""
    handles = [
        module.register_forward_pre_hook(hook, with_kwargs=True)
        if pre
        else module.register_forward_hook(hook, with_kwargs=True)
        for module, hook, pre in hooks
    ]
    try:
        with torch.no_grad():
            return model(**encoded(prompt)).logits
    finally:
        for handle in handles:
            handle.remove()


def replace_output_at(position, hidden):
    def hook(module, args, kwargs, output):
        edited = (output[0] if isinstance(output, tuple) else output).clone()
        if edited.shape[1] > 1:  # the prompt's forward pass, not a generated step
            edited[:, position] = hidden
        return (edited, *output[1:]) if isinstance(output, tuple) else edited

    return hook


def replace_hidden_states_at(position, hidden):
    def hook(module, args, kwargs):
        states = kwargs["hidden_states"].clone()
        states[:, position] = hidden
        return args, {**kwargs, "hidden_states": states}

    return hook


def recorder(seen, key, read):
    """A pre-hook recording ``read(args, kwargs)`` under ``key`` (the first call) and changing nothing."""

    def hook(module, args, kwargs):
        seen.setdefault(key, read(args, kwargs))

    return hook


def hidden_states(model, prompt):
    with torch.no_grad():
        return model(**encoded(prompt), output_hidden_states=True).hidden_states


# -- nnterp's spellings ---------------------------------------------------------


def experiment_nnterp_steer(model, vector):
    with model.trace(PROMPT):
        model.steer(layers=1, steering_vector=vector, factor=0.5, token_positions=torch.tensor([0, -1]), batch_index=0)
        nnterp = model.layers_output[1].save()
    with model.trace(PROMPT):
        model.steer(layers=1, vector=vector, factor=0.5, positions=[0, -1])
        ours = model.layers_output[1].save()
    with model.trace(PROMPT):
        unsteered = model.layers_output[1].save()
    return nnterp, ours, unsteered


def test_nnterp_steer_spellings_are_ours_on_both_engines(engines):
    hf, vllm = on_both(engines, experiment_nnterp_steer, engines.vector)
    for hf_value, vllm_value in zip(hf, vllm):
        close(vllm_value, hf_value)
    for nnterp, ours, unsteered in (hf, vllm):
        close(nnterp, ours, {"atol": 0, "rtol": 0})
        expected = unsteered.clone()
        expected[:, [0, -1]] += 0.5 * engines.vector
        close(nnterp, expected)


def test_steer_batch_index_steers_only_that_row(engines):
    model = engines.hf
    with model.trace(list(PAIR)):
        model.steer(0, steering_vector=engines.vector, batch_index=1)
        both = model.logits.save()
    with model.trace(PAIR[1]):
        model.steer(0, vector=engines.vector)
        alone = model.logits.save()
    close(both[0], plain_logits(engines.plain, PAIR[0])[0])
    close(both[1], alone[0])


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"steering_vector": torch.zeros(128), "vector": torch.zeros(128)}, ValueError, "two spellings of one"),
        ({"steering_vector": torch.zeros(128), "positions": 0, "token_positions": 0}, ValueError, "give one, not"),
        ({}, TypeError, "missing the vector argument"),
        ({"steering_vector": torch.zeros(128), "batch_index": "0"}, ValueError, "batch_index must be None"),
        ({"steering_vector": torch.zeros(128), "batch_index": 1}, ValueError, r"batch_index \[1\] is outside"),
    ],
)
def test_steer_refuses_bad_nnterp_arguments_on_both_engines(engines, kwargs, error, message):
    for model in (engines.hf, engines.vllm):
        with pytest.raises(error, match=message):
            with model.trace(PROMPT):
                model.steer(1, **kwargs)
                model.logits.save()
        with model.trace(PROMPT):
            logits = model.logits.save()
        assert torch.isfinite(logits).all()


def experiment_skip_layer_with(model):
    with model.trace(PROMPT):
        stream = model.layers_input[0].save()
        model.skip_layer(1, skip_with=stream)
        skipped = model.layers_output[1].save()
        logits = model.logits.save()
    return stream, skipped, logits


def test_skip_layer_with_a_tensor_hands_it_on_on_both_engines(engines):
    (stream, skipped, logits), (vllm_stream, vllm_skipped, vllm_logits) = on_both(engines, experiment_skip_layer_with)
    close(skipped, stream, {"atol": 0, "rtol": 0})
    close(vllm_skipped, vllm_stream, {"atol": 0, "rtol": 0})
    close(vllm_logits, logits)
    embedded = hidden_states(engines.plain, PROMPT)[0][0]
    truth = plain_logits(
        engines.plain, PROMPT, [(engines.plain.model.layers[1], replace_output_at(slice(None), embedded), False)]
    )
    close(logits, truth)


def experiment_sublayer_inputs(model, hidden):
    with model.trace(PROMPT):
        attention_input = model.attentions_input[1].save()
        mlp_input = model.mlps_input[1].save()
    with model.trace(PROMPT):
        model.attentions_input[2][:, -1] = hidden
        logits = model.logits.save()
    return attention_input, mlp_input, logits


def test_attention_and_mlp_inputs_equal_transformers_and_write_through_on_both_engines(engines):
    hf, vllm = on_both(engines, experiment_sublayer_inputs, engines.vector)
    for hf_value, vllm_value in zip(hf, vllm):
        close(vllm_value, hf_value)
    seen = {}
    block = engines.plain.model.layers[1]
    hooks = [
        (block.self_attn, recorder(seen, "attention", lambda args, kwargs: kwargs["hidden_states"]), True),
        (block.mlp, recorder(seen, "mlp", lambda args, kwargs: args[0]), True),
    ]
    plain_logits(engines.plain, PROMPT, hooks)
    close(hf[0], seen["attention"])
    close(hf[1], seen["mlp"])
    truth = plain_logits(
        engines.plain,
        PROMPT,
        [(engines.plain.model.layers[2].self_attn, replace_hidden_states_at(-1, engines.vector), True)],
    )
    close(hf[2], truth)


def test_module_spellings_and_attention_probability_availability(engines):
    model = engines.hf
    assert model.attentions[1] is model.layers[1].self_attn and model.mlps[2] is model.layers[2].mlp
    assert model.model.ln_final is model.ln_final is model.norm
    assert model._model is model._module
    with pytest.raises(TypeError, match="is a module, which is not written"):
        model.attentions[0] = None
    assert model.attn_probs_available and engines.vllm.attn_probs_available
    assert len(model.attentions_input) == model.num_layers


def test_print_source_shows_where_the_pattern_is_read_or_why_it_is_not(engines, capsys):
    engines.hf.attention_probabilities.print_source()
    shown = capsys.readouterr().out
    assert "Accessing attention_probabilities from model.model.layers.0.self_attn.source.attention_interface" in shown
    assert "def eager_attention_forward(" in shown and "nn_functional_softmax_0" in shown  # the operations, named
    assert "Full module source (model.model.layers.0.self_attn)" in shown and "def forward(" in shown
    engines.hf.layers_output.print_source(1)
    assert "Accessing layer_output from model.model.layers.1 (output)" in capsys.readouterr().out
    engines.vllm.attention_probabilities.print_source(2)
    shown = capsys.readouterr().out.strip()
    assert shown.startswith("model.model.layers.2.self_attn.attention_probabilities: rebuilt when read")
    assert "model.model.layers.2.self_attn.attn.inputs" in shown
    assert "after a request's first step: the earlier tokens' keys read back from vLLM's KV cache" in shown


# -- nnterp's constructor options ------------------------------------------------


def test_nnterp_constructor_options_are_taken_with_their_meaning(engines):
    fast = StandardizedTransformer(
        engines.path,
        enable_attention_probs=False,
        check_renaming=False,
        allow_dispatch=False,
        tokenizer_kwargs={"padding_side": "right"},
        attn_rename="no_such_module",
        remote=True,
    )
    assert fast.config._attn_implementation == "sdpa" and not fast.attn_probs_available
    assert "attn_implementation='eager'" in fast.support()["self_attn.attention_probabilities"]
    assert fast.tokenizer.padding_side == "right"
    assert not fast.dispatched  # remote=True: nothing loaded here, as for every model until a local trace
    assert StandardizedTransformer(engines.path, enable_attention_probs=True).attn_probs_available
    config = RenameConfig(attn_name="attention", ln_final_name=["ln_f", "final_norm"], mlp_name="ffn")
    taken = nnterp_options.take({"rename_config": config, "layers_rename": "blocks"}, "transformers")
    assert taken.rename == {
        "attention": "self_attn",
        "ln_f": "norm",
        "final_norm": "norm",
        "ffn": "mlp",
        "blocks": "layers",
    }


@pytest.mark.parametrize(
    "engine, kwargs, message",
    [
        ("transformers", {"enable_attention_probs": True, "attn_implementation": "sdpa"}, "needs attn_implementation"),
        (
            "vllm",
            {"rename_config": RenameConfig(attn_prob_source=object())},
            r"attn_prob_source=\.\.\.\) is not supported",
        ),
        ("transformers", {"rename_config": {"attn_name": "x"}}, "must be a RenameConfig"),
        ("transformers", {"tokenizer_kwargs": "right"}, "tokenizer_kwargs must be a dict"),
    ],
)
def test_nnterp_options_without_a_meaning_here_are_refused_before_loading(engine, kwargs, message):
    build = StandardizedVLLM if engine == "vllm" else StandardizedTransformer
    with pytest.raises((ValueError, TypeError), match=message):
        build(tiny.checkpoint("llama"), **kwargs)


# -- nnterp's research helpers ---------------------------------------------------


def test_logit_lens_and_next_token_probs_equal_transformers_on_both_engines(engines):
    hf, vllm = on_both(engines, lambda model: logit_lens(model, list(PAIR), return_inv_logits=True))
    for hf_value, vllm_value in zip(hf, vllm):
        close(vllm_value, hf_value)
    probs, inverse = hf
    assert probs.shape == inverse.shape == (2, 3, 512)
    for row, prompt in enumerate(PAIR):
        truth = torch.softmax(plain_logits(engines.plain, prompt)[0, -1], dim=-1)
        close(probs[row, -1], truth)
        states = hidden_states(engines.plain, prompt)
        first = engines.plain.lm_head(-engines.plain.model.norm(states[1][0, -1]))
        close(inverse[row, 0], torch.softmax(first, dim=-1))
    hf_next, vllm_next = on_both(engines, lambda model: compute_next_token_probs(model, list(PAIR)))
    close(hf_next, probs[:, -1])
    close(vllm_next, probs[:, -1])


def test_helpers_send_their_traces_as_remote_says_on_both_engines(engines):
    """``remote="local"``: every trace a helper runs is serialized and rebuilt as a server would, then run here."""

    def helpers(model, remote):
        source, target = PAIR
        return (
            logit_lens(model, list(PAIR), remote=remote),
            get_token_activations(model, [*PAIR, PROMPT[-13:]], layers=[1, 0], remote=remote),
            patchscope_lens(model, source, TargetPrompt(target, -1), layers=[0, 1], remote=remote),
            patchscope_generate(model, source, TargetPrompt(target, -1), 3, [1], remote=remote)[1],
        )

    for model in (engines.hf, engines.vllm):
        for sent, here in zip(helpers(model, "local"), helpers(model, False)):
            close(sent, here, {"atol": 0, "rtol": 0})


def test_token_activations_equal_the_hidden_states_on_both_engines(engines):
    prompts = [*PAIR, PROMPT[-13:]]
    hf, vllm = on_both(engines, lambda model: get_token_activations(model, prompts, layers=[1, 0]))
    close(vllm, hf)
    for row, prompt in enumerate(prompts):
        states = hidden_states(engines.plain, prompt)
        # hidden_states[i + 1] is block i's output (the last one is the final norm's instead)
        close(hf[:, row], torch.stack([states[2][0, -1], states[1][0, -1]]))
    batched = collect_token_activations_batched(engines.vllm, prompts, batch_size=2, layers=[1, 0])
    close(batched, vllm, {"atol": 1e-6, "rtol": 1e-6})


def test_patchscope_lens_equals_a_hooked_forward_on_both_engines(engines):
    source, target = PAIR
    hf, vllm = on_both(engines, lambda model: patchscope_lens(model, source, TargetPrompt(target, -1), layers=[0, 1]))
    close(vllm, hf)
    states = hidden_states(engines.plain, source)
    for column, layer in enumerate([0, 1]):
        hook = replace_output_at(-1, states[layer + 1][0, -1])
        truth = plain_logits(engines.plain, target, [(engines.plain.model.layers[layer], hook, False)])
        close(hf[0, column], torch.softmax(truth[0, -1], dim=-1))


def test_patchscope_generate_equals_hooked_greedy_generation_on_both_engines(engines):
    source, target = PAIR
    hf, vllm = on_both(engines, lambda model: patchscope_generate(model, source, TargetPrompt(target, -1), 6, [1]))
    assert hf[1].tolist() == vllm[1].tolist()
    states = hidden_states(engines.plain, source)
    handle = engines.plain.model.layers[1].register_forward_hook(
        replace_output_at(-1, states[2][0, -1]), with_kwargs=True
    )
    try:
        ids = encoded(target)["input_ids"]
        generated = engines.plain.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    finally:
        handle.remove()
    assert hf[1][0].tolist() == generated[0].tolist()


def test_patch_object_attn_lens_equals_hooked_attention_inputs_on_both_engines(engines):
    source, target = PAIR
    hf, vllm = on_both(
        engines, lambda model: patch_object_attn_lens(model, source, target, attn_idx_patch=3, num_patches=2)
    )
    close(vllm, hf)
    layers = engines.plain.model.layers
    seen = {}
    plain_logits(
        engines.plain,
        source,
        [(layers[i].self_attn, recorder(seen, i, lambda a, k: k["hidden_states"][0, -1]), True) for i in range(3)],
    )
    for start in range(3):
        hooks = [
            (layers[i].self_attn, replace_hidden_states_at(3, seen[i]), True) for i in range(start, min(3, start + 2))
        ]
        close(hf[0, start], torch.softmax(plain_logits(engines.plain, target, hooks)[0, -1], dim=-1))


def test_run_prompts_sums_the_targets_next_token_probabilities_on_both_engines(engines):
    prompts = [
        Prompt.from_strings(PAIR[0], {"target": ["H", "w"]}, engines.hf),
        Prompt.from_strings(PAIR[1], "G", engines.hf),
    ]
    hf, vllm = on_both(engines, lambda model: run_prompts(model, prompts, batch_size=1)["target"])
    close(vllm, hf)
    probs = compute_next_token_probs(engines.hf, list(PAIR))
    close(hf[:, 0], torch.stack([probs[i, p.target_tokens["target"]].sum() for i, p in enumerate(prompts)]))


def test_helpers_take_a_plain_nnsight_model_on_the_llama_layout(engines):
    from nnsight import LanguageModel

    plain = LanguageModel(str(engines.path), device_map="cpu")
    with plain.trace(PROMPT):
        native = get_layer_output(plain, 1).save()
    with engines.hf.trace(PROMPT):
        standardized = get_layer_output(engines.hf, 1).save()
    close(native, standardized)  # nnsight's LanguageModel runs sdpa attention, ours eager
    close(logit_lens(plain, PROMPT), logit_lens(engines.hf, PROMPT))


def test_get_first_tokens_finds_both_spellings_of_a_word():
    from transformers import AutoTokenizer

    from nnterp_vllm.checkpoints import smollm2

    tokenizer = AutoTokenizer.from_pretrained(smollm2())
    tokens = get_first_tokens(["Paris", "hello"], tokenizer)
    assert [tokenizer.decode([t]) for t in tokens] == ["Paris", " Paris", "hello", " hello"]
    assert get_first_tokens("hello", tiny.tokenizer()) == [tiny.tokenizer()("h").input_ids[0]]


def test_plot_topk_tokens_renders_the_top_tokens_per_layer(engines, tmp_path):
    probs = logit_lens(engines.hf, list(PAIR))
    figure = plot_topk_tokens(probs, engines.hf.tokenizer, k=3, file=tmp_path / "lens.png")
    assert (tmp_path / "lens.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "data:image/png;base64," in (tmp_path / "lens.html").read_text()
    panels = [axis for axis in figure.axes if axis.texts]
    assert len(panels) == 2
    top = probs[1, 2].topk(3).indices
    labels = {(round(t.get_position()[0]), round(t.get_position()[1])): t.get_text() for t in panels[1].texts}
    assert [labels[rank, 2] for rank in range(3)] == [repr(engines.hf.tokenizer.decode([int(t)])) for t in top]
    plot_topk_tokens(probs[0, -1], engines.hf.tokenizer, use_token_ids=True, file=tmp_path / "one.svg", save_html=False)
    assert (tmp_path / "one.svg").exists() and not (tmp_path / "one.html").exists()
    table = prompts_to_df([Prompt.from_strings(PAIR[0], {"target": "H"}, engines.hf)], engines.hf.tokenizer)
    assert table[0]["prompt"] == PAIR[0] and table[0]["target_string"] == "H"


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m: logit_lens(m, []), ValueError, "non-empty list of prompts"),
        (lambda m: get_token_activations(m), ValueError, "give prompts"),
        (lambda m: get_token_activations(m, PROMPT, idx=2), ValueError, "needs right padding"),
        (lambda m: get_token_activations(m, PROMPT, layers=[5]), ValueError, "num_layers=3"),
        (lambda m: collect_token_activations_batched(m, [PROMPT], batch_size=0), ValueError, "positive int"),
        (lambda m: patchscope_lens(m), ValueError, "give source_prompts"),
        (lambda m: patchscope_lens(m, PROMPT, latents=torch.zeros(3, 1, 128)), ValueError, "not both"),
        (lambda m: patchscope_lens(m, latents=torch.zeros(2, 1, 128)), ValueError, "a row per patched layer"),
        (lambda m: patchscope_lens(m, list(PAIR), [TargetPrompt("a", -1)]), ValueError, "as many target"),
        (lambda m: patchscope_generate(m, PROMPT, TargetPrompt("a", -1), 0), ValueError, "max_length must be"),
        (lambda m: patch_object_attn_lens(m, list(PAIR), [PROMPT] * 3, 0), ValueError, "one per target"),
        (lambda m: patch_object_attn_lens(m, PROMPT, PROMPT, 0, num_patches=0), ValueError, "num_patches must be"),
        (lambda m: patchscope_generate(m, PROMPT, TargetPrompt("a", -1), 2, max_batch_size=0), ValueError, "max_batch"),
        (lambda m: patchscope_lens(m, PROMPT, 5), ValueError, "target prompts must be a str"),
        (lambda m: TargetPromptBatch.from_prompts("a", 1.5), ValueError, "index_to_patch must be"),
        (lambda m: ModuleAccessor(m._model, RenameConfig(vocab_size_config_key="n")), ValueError, "family module"),
        (lambda m: plot_topk_tokens(torch.zeros(2, 2, 2, 2), m.tokenizer), ValueError, "must be a"),
        (lambda m: plot_topk_tokens(torch.zeros(3, 512), m.tokenizer, k=0), ValueError, "k must be an int"),
    ],
)
def test_helpers_refuse_bad_arguments_before_running(engines, call, error, message):
    calls = []
    handle = engines.hf._module.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(error, match=message):
            call(engines.hf)
    finally:
        handle.remove()
    assert not calls


def test_patch_object_attn_lens_refuses_a_model_without_attention_before_running():
    model = StandardizedTransformer(tiny.checkpoint("mamba"))
    with pytest.raises(UnavailableValue, match="patch_object_attn_lens needs the attention modules' input"):
        patch_object_attn_lens(model, PROMPT, PROMPT, 0)
