"""Every family module's values, checked against plain transformers and PyTorch hooks on a tiny random checkpoint."""

from __future__ import annotations

import os
import warnings

import pytest
import reference
import tiny
import torch
from nnsight.intervention.envoy import Envoy

from nnterp_vllm import StandardizedTransformer, UnavailableValue, families
from nnterp_vllm.components import Value
from nnterp_vllm.families import default

#: Every family module; the coverage harness (tests/family_coverage.py) adds model_types without one, and can
#: serve every type with the default family alone, through these two variables.
#: Multimodal types are served by their text model's family, nested in the wrapper: checked here as well.
FAMILIES = [name for name in os.environ.get("NNTERP_COVERAGE_TYPES", "").split(",") if name] or [
    *families.known(),
    *tiny.GROUPS["multimodal"],
]
FORCED_FAMILY = default if os.environ.get("NNTERP_COVERAGE_FAMILY") == "default" else None
#: Families whose scores carry a position bias (ALiBi), so equal keys do not give a uniform pattern.
POSITION_BIASED = {"bloom", "mpt", "inkling_text"}
#: Models whose ``output_hidden_states`` are the blocks' outputs and the final norm's, without the embeddings.
BLOCK_OUTPUTS_ONLY = {"rwkv", "mamba", "mamba2", "falcon_mamba"}
ATOL = 1e-5


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    """(standardized model, plain transformers model) loaded from the same tiny checkpoint."""
    path = tiny.checkpoint(request.param)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a type without a module warns that the default family serves it
        model = StandardizedTransformer(path, family=FORCED_FAMILY)
    return request.param, model, reference.load(path)


def native(model, envoy):
    """The plain model's path of an envoy's module (the standardized root wraps the model as ``model``)."""
    return envoy.path.split(".", 1)[1]


def served(model, name, layer):
    """Whether ``model.support()`` claims value ``name`` on block ``layer``: what the test must then verify.

    A value of a module no block has (attention on an attention-free model) is not in the table: not served.
    """
    entry = model.support().get(name, "no block has this module")
    return entry is None or (isinstance(entry, dict) and layer not in entry)


def has_module(block, name, value=None):
    """Whether ``block`` has a module ``name`` (one serving ``value``, when given: a hybrid block's native
    ``self_attn`` may be its linear-attention mixer)."""
    child = block.__dict__.get(name)
    return isinstance(child, Envoy) and (value is None or value in getattr(type(child), "values", dict)())


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual.detach().float(), expected.detach().float(), atol=atol, rtol=1e-4)


def test_family_classes_are_served(pair):
    model_type, model, _ = pair
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # a multimodal type is served by its text model's family
        family = FORCED_FAMILY or families.lookup(model.config.get_text_config().model_type)
    assert model.family is family
    native_blocks = model.get(model._aliases["layers"])
    for i, block in enumerate(model.layers):
        assert isinstance(block, family.Layer) and block is native_blocks[i]
        if served(model, "self_attn.attention_output", i):
            assert isinstance(block.self_attn, family.Attention)
            native = native_blocks[i]
            assert block.self_attn is native.get(native._aliases.get("self_attn", "self_attn"))


def test_hidden_states_and_attentions_match_transformers(pair):
    model_type, model, hf = pair
    expected = reference.run(hf, output_hidden_states=True, output_attentions=True)
    outputs, patterns, final = [], [], None
    final_norm_served = model.support()["final_norm_output"] is None
    with model.trace(reference.PROMPT):
        first_input = model.layers[0].layer_input.save()
        for i, block in enumerate(model.layers):
            if served(model, "self_attn.attention_probabilities", i):
                patterns.append((i, block.self_attn.attention_probabilities.save()))
            outputs.append(block.layer_output.save())
        if final_norm_served:
            final = model.final_norm_output.save()
        logits = model.logits.save()
    # transformers' hidden_states start with the embeddings, except where a model records block outputs only.
    after_blocks = len(expected.hidden_states) == model.num_layers + 1 and model_type in BLOCK_OUTPUTS_ONLY
    if not after_blocks:
        close(first_input, expected.hidden_states[0])
    for i, output in enumerate(outputs[:-1]):
        close(output, expected.hidden_states[i if after_blocks else i + 1])
    # Without a readable final norm, the family's final_norm (project_on_vocab's) must give the last hidden state.
    close(final if final_norm_served else model._final_norm(outputs[-1]), expected.hidden_states[-1])
    # A hybrid records the patterns of its attention blocks only, in block order.
    attention_blocks = [
        i for i, block in enumerate(model.layers) if has_module(block, "self_attn", "attention_probabilities")
    ]
    for i, pattern in patterns:
        recorded = i if len(expected.attentions) == model.num_layers else attention_blocks.index(i)
        close(pattern, expected.attentions[recorded])
        close(pattern.sum(-1), torch.ones_like(pattern.sum(-1)))
    close(logits, expected.logits)


def test_residual_identity(pair):
    """``layer_output == layer_input + mixer_output + mlp_output``; the mixer is the attention where it is one."""
    _, model, _ = pair
    rows = []
    with model.trace(reference.PROMPT):
        for i, block in enumerate(model.layers):
            # A block without an MLP (a pure mamba block) adds its mixer's output alone.
            with_mlp = served(model, "mlp_output", i)
            if not served(model, "mixer_output", i) or (not with_mlp and has_module(block, "mlp")):
                continue
            layer_input = block.layer_input.save()
            attention_output = block.attention_output.save() if served(model, "attention_output", i) else None
            mixer_output = block.mixer_output.save()
            mlp_output = block.mlp_output.save() if with_mlp else 0
            rows.append((layer_input, attention_output, mixer_output, mlp_output, block.layer_output.save()))
    assert rows or model.support()["mixer_output"], "no block verified"
    for layer_input, attention_output, mixer_output, mlp_output, layer_output in rows:
        close(layer_input + mixer_output + mlp_output, layer_output)
        if attention_output is not None:
            close(attention_output, mixer_output)


def test_head_decomposition(pair):
    _, model, _ = pair
    rows = []
    with model.trace(reference.PROMPT):
        for i, block in enumerate(model.layers):
            if served(model, "self_attn.attention_head_outputs", i):
                attention = block.self_attn
                premix = attention.attention_premix.save()
                heads = attention.attention_head_outputs.save()
                rows.append((i, premix, heads, attention.output_projection.output.save()))
    for i, premix, heads, projected in rows:
        projection = model.layers[i].self_attn.output_projection._module
        bias = projection.bias if getattr(projection, "bias", None) is not None else 0
        close(heads.sum(dim=2) + bias, projected)
        close(projection(premix.reshape(*premix.shape[:2], -1)), projected)
        assert heads.shape[2] == premix.shape[2]


def first_attention_layer(model, name="self_attn.attention_probabilities"):
    layers = [i for i in range(model.num_layers) if served(model, name, i)]
    if not layers:
        pytest.skip(f"{name} is not served on this family: {model.support().get(name, 'no block has it')}")
    return layers[0]


def test_queries_keys_values_shapes(pair):
    _, model, _ = pair
    layer = first_attention_layer(model, "self_attn.attention_queries")
    with model.trace(reference.PROMPT):
        attention = model.layers[layer].self_attn
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
    layer = first_attention_layer(model, "self_attn.attention_keys")
    with model.trace(reference.PROMPT):
        attention = model.layers[layer].self_attn
        attention.attention_keys = torch.zeros_like(attention.attention_keys)
        probabilities = attention.attention_probabilities.save()
    seq = probabilities.shape[-1]
    causal = torch.tril(torch.ones(seq, seq)) / torch.arange(1, seq + 1).unsqueeze(1)
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    if window is None or window >= seq:
        close(probabilities[0, 0], causal)


def test_writing_values_and_heads(pair):
    _, model, _ = pair
    layer = first_attention_layer(model, "self_attn.attention_head_outputs")
    with model.trace(reference.PROMPT):
        attention = model.layers[layer].self_attn
        heads = attention.attention_head_outputs.save()
        edited = heads.clone()
        edited[:, :, 0] = 0
        attention.attention_head_outputs = edited
        projected = attention.output_projection.output.save()
    bias = getattr(model.layers[layer].self_attn.output_projection._module, "bias", None)
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
        hf, native(model, model.layers[1]), lambda _, out: out * 0.5 if edit == "scale" else torch.zeros_like(out)
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
    close(
        logits, reference.with_block_output(hf, native(model, model.layers[1]), lambda block_in, _: block_in), atol=1e-4
    )


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

    close(logits, reference.with_block_output(hf, native(model, model.layers[1]), add), atol=1e-4)


def routed_layers(model, name="mlp.router_logits"):
    layers = [i for i in range(model.num_layers) if served(model, name, i)]
    if not layers:
        pytest.skip(f"{name} is not served on this family: {model.support().get(name, 'no block has it')}")
    return layers


def test_project_on_vocab_of_the_last_block_gives_the_logits(pair):
    _, model, _ = pair
    if model.family is default or FORCED_FAMILY:
        pytest.skip("the default family refuses project_on_vocab")
    with model.trace(reference.PROMPT):
        projected = model.project_on_vocab(model.layers[-1].layer_output).save()
        logits = model.logits.save()
    close(projected, logits, atol=1e-4)


def test_router_logits_match_transformers(pair):
    """Against transformers' ``output_router_logits`` where it records exactly one router per sparse block, and
    always against a hook on each router module."""
    _, model, hf = pair
    layers = routed_layers(model)
    recorded = reference.run(hf, output_router_logits=True).router_logits
    got = []
    with model.trace(reference.PROMPT):
        for i in layers:
            got.append(model.layers[i].mlp.router_logits.save())
    hooked = []
    for i in layers:
        mlp = model.layers[i].mlp
        output = reference.output_of(hf, native(model, getattr(mlp, mlp.ROUTER)))
        hooked.append(mlp.values()["router_logits"].pick("output", output, mlp.ROUTER_LOGITS))
    expected = [hooked] + ([list(recorded)] if recorded is not None and len(recorded) == len(layers) else [])
    for logits, *truths in zip(got, *expected):
        assert logits.shape == (*reference.encode()["input_ids"].shape, model.num_experts)
        for truth in truths:
            close(logits.reshape(-1, logits.shape[-1]), truth)


def test_expert_indices_and_weights_match_a_hook(pair):
    _, model, hf = pair
    layer = routed_layers(model, "mlp.expert_indices")[0]
    mlp = model.layers[layer].mlp
    with model.trace(reference.PROMPT):
        indices = mlp.expert_indices.save()
        weights = mlp.expert_weights.save()
    args = reference.inputs_of(hf, native(model, getattr(mlp, mlp.EXPERTS)))
    assert indices.shape[-1] == weights.shape[-1] == model.num_experts_per_token
    assert torch.equal(indices.reshape(-1, indices.shape[-1]), args[1])
    close(weights.reshape(-1, weights.shape[-1]), args[2])


def test_writing_expert_indices_matches_a_hook(pair):
    _, model, hf = pair
    layer = routed_layers(model, "mlp.expert_indices")[0]
    mlp = model.layers[layer].mlp

    def rerouted(indices):
        return (indices + 1) % model.num_experts

    with model.trace(reference.PROMPT):
        mlp.expert_indices = rerouted(mlp.expert_indices)
        logits = model.logits.save()
    expected = reference.with_input_edit(hf, native(model, getattr(mlp, mlp.EXPERTS)), 1, rerouted)
    close(logits, expected, atol=1e-4)


def test_support_is_honest(pair):
    """Every value support() claims was verified above; every value it refuses raises with its reason."""
    _, model, _ = pair
    table = model.support()
    for name in ("layer_input", "layer_output", "logits", "next_token_probs"):
        assert table[name] is None, (name, table[name])
    for name, entry in table.items():
        if name == "engine" or entry is None:
            continue
        module, _, value = name.rpartition(".")
        if isinstance(getattr(type(model), name, None), Value):
            hosts = [model]
        else:
            # A module's value is refused on the blocks that have the module; the others have nothing to read.
            blocks = [model.layers[i] for i in (entry if isinstance(entry, dict) else range(model.num_layers))]
            hosts = [getattr(b, module) if module else b for b in blocks if not module or has_module(b, module, value)]
        for host in hosts[:1]:
            with pytest.raises(UnavailableValue):
                with model.trace(reference.PROMPT):
                    getattr(host, value).save()
