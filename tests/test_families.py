"""Every family module's values, checked against plain transformers and PyTorch hooks on a tiny random checkpoint."""

from __future__ import annotations

import pytest
import reference
import tiny
import torch

from nnterp_vllm import StandardizedTransformer, families

FAMILIES = [
    "bloom",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gpt2",
    "gpt_neox",
    "gptj",
    "llama",
    "mistral",
    "olmo2",
    "opt",
    "phi3",
    "qwen2",
    "qwen3",
]
#: Families whose scores carry a position bias (ALiBi), so equal keys do not give a uniform pattern.
POSITION_BIASED = {"bloom"}
ATOL = 1e-5


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    """(standardized model, plain transformers model) loaded from the same tiny checkpoint."""
    path = tiny.checkpoint(request.param)
    return request.param, StandardizedTransformer(path), reference.load(path)


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual.detach().float(), expected.detach().float(), atol=atol, rtol=1e-4)


def test_every_listed_family_is_known():
    assert set(FAMILIES) <= set(families.known())


def test_family_classes_are_served(pair):
    model_type, model, _ = pair
    family = families.lookup(model_type)
    assert model.family is family
    assert type(model.layers[0]) is family.Layer
    assert type(model.layers[0].self_attn) is family.Attention
    native_block = model.get(model._aliases["layers"])[0]
    native_attention = getattr(native_block, native_block._aliases.get("self_attn", "self_attn"))
    assert model.layers[0].self_attn is native_attention
    assert model.layers[0] is native_block


def test_hidden_states_and_attentions_match_transformers(pair):
    _, model, hf = pair
    expected = reference.run(hf, output_hidden_states=True, output_attentions=True)
    outputs, patterns = [], []
    with model.trace(reference.PROMPT):
        first_input = model.layers[0].layer_input.save()
        for block in model.layers:
            patterns.append(block.self_attn.attention_probabilities.save())
            outputs.append(block.layer_output.save())
        final = model.final_norm_output.save()
        logits = model.logits.save()
    close(first_input, expected.hidden_states[0])
    for i, output in enumerate(outputs[:-1]):
        close(output, expected.hidden_states[i + 1])
    close(final, expected.hidden_states[-1])
    for pattern, attention in zip(patterns, expected.attentions):
        close(pattern, attention)
        close(pattern.sum(-1), torch.ones_like(pattern.sum(-1)))
    close(logits, expected.logits)


def test_residual_identity_and_head_decomposition(pair):
    _, model, _ = pair
    rows = []
    with model.trace(reference.PROMPT):
        for block in model.layers:
            attention = block.self_attn
            layer_input = block.layer_input.save()
            premix = attention.attention_premix.save()
            heads = attention.attention_head_outputs.save()
            projected = attention.output_projection.output.save()
            attention_output = block.attention_output.save()
            mlp_output = block.mlp_output.save()
            layer_output = block.layer_output.save()
            rows.append((layer_input, premix, heads, projected, attention_output, mlp_output, layer_output))
    for i, (layer_input, premix, heads, projected, attention_output, mlp_output, layer_output) in enumerate(rows):
        close(layer_input + attention_output + mlp_output, layer_output)
        projection = model.layers[i].self_attn.output_projection._module
        bias = projection.bias if getattr(projection, "bias", None) is not None else 0
        close(heads.sum(dim=2) + bias, projected)
        close(projection(premix.reshape(*premix.shape[:2], -1)), projected)
        assert heads.shape[2] == premix.shape[2]


def test_queries_keys_values_shapes(pair):
    _, model, _ = pair
    with model.trace(reference.PROMPT):
        attention = model.layers[1].self_attn
        queries = attention.attention_queries.save()
        keys = attention.attention_keys.save()
        values = attention.attention_values.save()
        scores = attention.attention_scores.save()
        probabilities = attention.attention_probabilities.save()
    batch, heads, seq, _ = queries.shape
    assert keys.shape[0] == values.shape[0] == batch and keys.shape[2] == seq
    assert heads % keys.shape[1] == 0
    assert scores.shape == probabilities.shape == (batch, heads, seq, seq)
    close(torch.softmax(scores.float(), dim=-1), probabilities)


def test_writing_keys_equal_gives_uniform_causal_pattern(pair):
    model_type, model, _ = pair
    if model_type in POSITION_BIASED:
        pytest.skip("ALiBi adds a position bias to equal scores")
    with model.trace(reference.PROMPT):
        attention = model.layers[0].self_attn
        attention.attention_keys = torch.zeros_like(attention.attention_keys)
        probabilities = attention.attention_probabilities.save()
    seq = probabilities.shape[-1]
    causal = torch.tril(torch.ones(seq, seq)) / torch.arange(1, seq + 1).unsqueeze(1)
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    if window is None or window >= seq:
        close(probabilities[0, 0], causal)


def test_writing_values_and_heads(pair):
    _, model, _ = pair
    with model.trace(reference.PROMPT):
        attention = model.layers[0].self_attn
        heads = attention.attention_head_outputs.save()
        edited = heads.clone()
        edited[:, :, 0] = 0
        attention.attention_head_outputs = edited
        projected = attention.output_projection.output.save()
    bias = getattr(model.layers[0].self_attn.output_projection._module, "bias", None)
    close(projected, heads[:, :, 1:].sum(dim=2) + (bias if bias is not None else 0))


@pytest.mark.parametrize("edit", ["scale", "zero_in_place"])
def test_writing_layer_output_matches_a_hook(pair, edit):
    _, model, hf = pair
    with model.trace(reference.PROMPT):
        if edit == "scale":
            model.layers[1].layer_output = model.layers[1].layer_output * 0.5
        else:
            model.layers[1].layer_output[:] = 0
        logits = model.logits.save()
    expected = reference.with_block_output(
        hf, 1, lambda _, out: out * 0.5 if edit == "scale" else torch.zeros_like(out)
    )
    close(logits, expected, atol=1e-4)


def test_skip_layers_hands_input_on(pair):
    _, model, hf = pair
    with model.trace(reference.PROMPT):
        model.skip_layers(1, 1)
        logits = model.logits.save()
    with model.trace(reference.PROMPT):
        skipped_in = model.layers[1].layer_input.save()
        model.skip_layers(1)
        skipped_out = model.layers[1].layer_output.save()
    close(skipped_out, skipped_in)
    close(logits, reference.with_block_output(hf, 1, lambda block_in, _: block_in), atol=1e-4)


def test_steer_equals_adding_by_hand(pair):
    _, model, hf = pair
    vector = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(1))
    with model.trace(reference.PROMPT):
        model.steer(1, vector, factor=2.0, positions=[0, 2])
        logits = model.logits.save()

    def add(_, out):
        out = out.clone()
        out[:, [0, 2]] += 2.0 * vector
        return out

    close(logits, reference.with_block_output(hf, 1, add), atol=1e-4)


def test_support_lists_every_value(pair):
    _, model, _ = pair
    table = model.support()
    for name in ("layer_input", "layer_output", "attention_output", "mlp_output", "logits", "next_token_probs"):
        assert table[name] is None, (name, table[name])
    for name in ("attention_probabilities", "attention_head_outputs", "attention_premix", "attention_queries"):
        assert table[f"self_attn.{name}"] is None
