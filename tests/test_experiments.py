"""Experiments at serving throughput: activation patching, checked against transformers' own model with forward hooks.

- `Patch` sets a block's ``layer_output``, or what its attention or its MLP adds, at prompt positions, inside the
  steered engine's compiled graph and in a trace on either engine (``model.patch``), each equal to a forward hook
  setting the same rows on transformers' model.
- `patch_sweep` on the steered engine (every cell one request of one batch, its metric read in the worker) and on
  transformers equals a TransformerLens-style loop of hooked forwards, one per cell.
- `Probe`s read per token in the engine equal ``h @ w + b``; steering gated by a probe (``when=``) acts only on the
  tokens whose read passes, as a hook gating the same addition does: in the engine, and in a trace on either engine
  (``model.steer(..., when=...)``).
- Bad patches, sweeps, probes and gates are refused before any work, naming what is wrong.
"""

from __future__ import annotations

import pytest
import reference
import tiny
import torch
from test_steering import STEPS, held_saes, steered_engine, tokens_and_logprobs
from vllm import SamplingParams

from nnterp_vllm import (
    Ablate,
    LogitDiff,
    Logprob,
    Patch,
    Probe,
    Recovered,
    StandardizedTransformer,
    Steering,
    patch_sweep,
)

GREEDY = {"temperature": 0.0, "max_tokens": STEPS, "ignore_eos": True, "logprobs": 0}
PROMPT_TOKENS = len(tiny.tokenizer()(reference.PROMPT)["input_ids"])


@pytest.fixture(scope="module")
def path():
    return tiny.checkpoint("llama")


@pytest.fixture(scope="module")
def steered(path, tmp_path_factory):
    """The steering tests' engine (`steered_engine`): it keeps every patched value at every block."""
    _, saes = held_saes(tmp_path_factory.mktemp("saes"), tiny.SIZES["hidden_size"])
    llm = steered_engine(path, saes["topk"], "llama")
    yield llm
    llm.shutdown()


def hooked_patch_generation(path, prompt_ids: list[int], patches: list[Patch], added: list[Steering] = ()):
    """Greedy tokens and logprobs of transformers' own model with ``patches`` set by forward hooks on the prompt's
    forward (each block's output, its attention's or its MLP's), after ``added`` vectors at the block outputs."""
    model = reference.load(path)
    blocks = reference.blocks(model)
    seen: dict[int, int] = {}

    def module_of(patch: Patch, layer: int) -> torch.nn.Module:
        block = blocks[layer]
        return {"layer_output": block, "attention_output": block.self_attn, "mlp_output": block.mlp}[patch.value]

    def hook(patch: Patch, key: int):
        def edit(module, args, out):
            first = seen.setdefault(key, 0) == 0
            seen[key] += 1
            if not first:
                return None
            stream = (out[0] if isinstance(out, tuple) else out).clone()
            length = stream.shape[1]
            for position, row in zip(patch.positions, patch.rows()):
                stream[0, position % length] = row
            return (stream, *out[1:]) if isinstance(out, tuple) else stream

        return edit

    def add(spec: Steering):
        def edit(module, args, out):
            stream = out[0] if isinstance(out, tuple) else out
            stream = stream + spec.factor * spec.vector
            return (stream, *out[1:]) if isinstance(out, tuple) else stream

        return edit

    handles = []
    for spec in added:
        handles += [blocks[layer].register_forward_hook(add(spec)) for layer in spec.layers]
    for index, patch in enumerate(patches):
        for layer in patch.layers:
            handles.append(module_of(patch, layer).register_forward_hook(hook(patch, index * 1000 + layer)))
    return reference.greedy_with_hooks(model, prompt_ids, handles, STEPS)


def rows(count: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(count, hidden, generator=torch.Generator().manual_seed(seed)) * 0.5


def experiment_patch(model, prompt: str, rows: torch.Tensor) -> torch.Tensor:
    """What a researcher writes: what block 1's MLP adds set to two rows a clean run kept, then the logits."""
    with model.trace(prompt):
        model.patch(1, rows, [1, -2], value="mlp_output")
        logits = model.logits.save()
    return logits


def experiment_gated(model, prompt: str, vector: torch.Tensor, probe: Probe, threshold: float):
    """What a researcher writes: block 2's output steered only on the tokens whose probe reads above the threshold,
    then that output and the logits."""
    with model.trace(prompt):
        model.steer(layers=2, vector=vector, when=(probe, ">", threshold))
        stream = model.layers[2].layer_output.save()
        logits = model.logits.save()
    return stream, logits


#: The blocks the gates of the gated experiments read: before the steered block 2, and block 2 itself.
GATE_LAYERS = (0, 2)


@pytest.fixture(scope="module")
def traced(path):
    """The trace path's experiments, each written once and run on each engine: ``{engine: {experiment: result}}``.
    Its tests come first in the module: the vLLM engine it builds is shut down before the steered engine of the
    others starts."""
    from nnterp_vllm import StandardizedVLLM

    hf = StandardizedTransformer(path)
    ids = hf.tokenizer(reference.PROMPT)["input_ids"]
    patched = rows(2, hf.hidden_size, 4)
    gates = {layer: half_open_gate(path, ids, layer) for layer in GATE_LAYERS}
    on_vllm = StandardizedVLLM(path, dtype="float32", dispatch=True, max_model_len=256)
    try:
        return {
            name: {
                "patch": experiment_patch(model, reference.PROMPT, patched),
                **{
                    f"gated at {layer}": experiment_gated(model, reference.PROMPT, *gate)
                    for layer, gate in gates.items()
                },
            }
            for name, model in {"transformers": hf, "vllm": on_vllm}.items()
        }
    finally:
        on_vllm.shutdown()


def test_model_patch_in_a_trace_sets_the_same_rows_on_both_engines_as_a_hook(path, traced):
    """The trace path, written once and run on each engine."""
    plain = reference.load(path)
    ids = plain_ids(reference.PROMPT)
    patched = rows(2, plain.config.hidden_size, 4)
    logits = {name: results["patch"] for name, results in traced.items()}

    def hook(module, args, out):
        out = out.clone()
        out[0, 1], out[0, -2] = patched[0], patched[1]
        return out

    handle = reference.blocks(plain)[1].mlp.register_forward_hook(hook)
    try:
        with torch.no_grad():
            expected = plain(ids).logits
    finally:
        handle.remove()
    torch.testing.assert_close(logits["transformers"], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits["vllm"][0, -1], expected[0, -1], atol=1e-4, rtol=1e-4)  # vLLM: the last


@pytest.mark.parametrize("probe_layer", GATE_LAYERS)
def test_gated_steering_in_a_trace_equals_the_hook_and_the_engine_on_both_engines(path, traced, steered, probe_layer):
    """``model.steer(..., when=(probe, ">", t))`` in a trace, on each engine, equals a hook adding the vector only where
    the probe (read at its block's output before the steering there) passes, and the compiled engine's gated
    `Steering`: its first token and that token's logprob."""
    ids = plain_ids(reference.PROMPT)[0].tolist()
    vector, probe, threshold = half_open_gate(path, ids, probe_layer)
    expected_stream, expected = hooked_gated_forward(path, ids, vector, probe, threshold, 2)
    hf_stream, hf_logits = traced["transformers"][f"gated at {probe_layer}"]
    vllm_stream, vllm_logits = traced["vllm"][f"gated at {probe_layer}"]
    torch.testing.assert_close(hf_stream, expected_stream, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hf_logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vllm_stream, expected_stream, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(vllm_logits[0, -1], expected[0, -1], atol=1e-4, rtol=1e-4)  # vLLM: the last
    gated = Steering(2, vector, when=(probe, ">", threshold))
    (output,) = steered.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY), [gated])
    tokens, logprobs = tokens_and_logprobs(output)
    logprob = expected[0, -1].log_softmax(-1)
    assert tokens[0] == int(logprob.argmax())
    assert float(logprobs[0]) == pytest.approx(float(logprob[tokens[0]]), abs=1e-4)


@pytest.mark.parametrize(
    "steer, message",
    [
        (
            lambda model, n: model.steer(0, torch.ones(n), when=(Probe(torch.ones(n), layer=2), ">", 0.0)),
            r"steer: when reads block 2's output, after blocks \[0\] the spec acts on",
        ),
        (
            lambda model, n: model.cap([1, 2], torch.ones(n), max=1.0, when=(Probe(torch.ones(n), layer=2), ">", 0)),
            r"cap: when reads block 2's output, after blocks \[1\]",
        ),
        (lambda model, n: model.steer(1, torch.ones(n), when=(Probe(torch.ones(7)), ">", 0.0)), "weight is 7 wide"),
        (lambda model, n: model.ablate(1, torch.ones(n), when=(Probe(torch.ones(n)), "==", 0)), "op one of"),
        (lambda model, n: model.ablate("all", torch.ones(n), when=(Probe(torch.ones(n)), ">", 0)), "before any block"),
    ],
)
def test_bad_gates_in_a_trace_are_refused_before_any_edit(path, steer, message):
    model = StandardizedTransformer(path)
    with model.trace(reference.PROMPT):
        plain = model.logits.save()
    with pytest.raises(ValueError, match=message):
        with model.trace(reference.PROMPT):
            steer(model, model.hidden_size)
            model.logits.save()
    with model.trace(reference.PROMPT):
        after = model.logits.save()
    torch.testing.assert_close(after, plain, atol=0, rtol=0)  # nothing was left behind


@pytest.mark.parametrize("value", ["layer_output", "attention_output", "mlp_output"])
def test_a_patch_sets_the_value_at_its_positions_as_a_hook_does(path, steered, value):
    ids = steered.get_tokenizer()(reference.PROMPT)["input_ids"]
    hidden = steered.hidden_size
    patches = [Patch(rows(3, hidden, 1), layers=1, positions=[2, 5, -1], value=value)]
    if value == "layer_output":  # a second patch at another block, one row for both its positions, beside an add
        patches.append(Patch(rows(1, hidden, 2)[0], layers=[0, 2], positions=[1, 3], value=value))
    added = [Steering(2, rows(1, hidden, 3)[0], factor=2.0)]
    (output,) = steered.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY), [*patches, *added])
    tokens, logprobs = tokens_and_logprobs(output)
    expected, expected_logprobs = hooked_patch_generation(path, ids, patches, added)
    assert tokens == expected
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda n: Patch(rows(2, n, 0), layers=1, positions=[1, 2, 3]), "vectors has 2 rows for 3 positions"),
        (lambda n: Patch(rows(1, n, 0)[0], layers=1, positions=[1, 1]), r"each position is set once; \[1, 1\]"),
        (lambda n: Patch(rows(1, n, 0)[0], layers=1, positions="prompt"), "positions must be a non-empty list"),
        (lambda n: Patch(rows(1, n, 0)[0], layers=1, positions=[0], value="logits"), "value must be one of"),
        (lambda n: Patch(rows(1, n, 0)[0], positions=[0]), "name the blocks and the prompt positions"),
        (lambda n: [Patch(rows(1, 7, 0)[0], layers=1, positions=[0])], r"shape \[hidden_size\] = \[128\]"),
        (lambda n: [Patch(rows(1, n, 0)[0], layers=1, positions=[400])], r"position\(s\) \[400\] are outside"),
        (lambda n: [Patch(rows(1, n, 0)[0], layers=1, positions=[0, -PROMPT_TOKENS])], "name one position of the"),
        (
            lambda n: [Patch(rows(1, n, 0)[0], layers=1, positions=[2]), Patch(rows(1, n, 1)[0], 1, positions=[2])],
            r"both set layers.1.layer_output at position 2",
        ),
    ],
)
def test_bad_patches_are_refused_before_the_engine_sees_them(steered, make, message):
    requests = steered.request_counter.counter
    with pytest.raises(ValueError, match=message):
        spec = make(steered.hidden_size)
        steered.generate(reference.PROMPT, SamplingParams(max_tokens=2), spec)
    assert steered.request_counter.counter == requests


CLEAN, CORRUPT = (
    "When Mary and John went out, John gave the ball to",
    "When Mary and John went out, Mary gave the ball to",
)


def hook_loop(path, clean_ids, corrupt_ids, layers, positions, value, measure) -> tuple[float, float, torch.Tensor]:
    """The sweep as researchers write it with hooks on transformers' own model: one forward keeping the clean run's
    values, then one hooked forward per (layer, position) cell; ``measure`` reads the last position's logits."""
    model = reference.load(path)
    blocks = reference.blocks(model)

    def module(layer):
        block = blocks[layer]
        return {"layer_output": block, "attention_output": block.self_attn, "mlp_output": block.mlp}[value]

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    kept = {}
    handles = [
        module(layer).register_forward_hook(
            lambda m, a, out, layer=layer: kept.__setitem__(layer, first(out)[0].clone())
        )
        for layer in layers
    ]
    with torch.no_grad():
        clean_logits = model(torch.tensor([clean_ids])).logits[0, -1]
        for handle in handles:
            handle.remove()
        corrupt_logits = model(torch.tensor([corrupt_ids])).logits[0, -1]
        values = torch.empty(len(layers), len(positions))
        for i, layer in enumerate(layers):
            for j, position in enumerate(positions):

                def patched(m, a, out, layer=layer, position=position):
                    stream = first(out).clone()
                    stream[0, position] = kept[layer][position]
                    return (stream, *out[1:]) if isinstance(out, tuple) else stream

                handle = module(layer).register_forward_hook(patched)
                values[i, j] = measure(model(torch.tensor([corrupt_ids])).logits[0, -1])
                handle.remove()
    return measure(clean_logits), measure(corrupt_logits), values


@pytest.mark.parametrize("value", ["layer_output", "attention_output"])
def test_a_patch_sweep_equals_a_hook_loop_on_both_engines(path, steered, value):
    tokenizer = steered.get_tokenizer()
    clean_ids, corrupt_ids = tokenizer(CLEAN)["input_ids"], tokenizer(CORRUPT)["input_ids"]
    correct, wrong = tokenizer(" M", add_special_tokens=False)["input_ids"][0], 300
    positions = [1, 5, len(clean_ids) - 18, -3, -1]
    metric = LogitDiff(correct, wrong)
    on_vllm = patch_sweep(steered, CLEAN, CORRUPT, positions=positions, metric=metric, value=value)
    on_hf = patch_sweep(StandardizedTransformer(path), CLEAN, CORRUPT, positions=positions, metric=metric, value=value)
    resolved = sorted({p % len(clean_ids) for p in positions})
    clean, corrupt, values = hook_loop(
        path, clean_ids, corrupt_ids, [0, 1, 2], resolved, value, lambda logits: float(logits[correct] - logits[wrong])
    )
    for sweep in (on_vllm, on_hf):
        assert (sweep.layers, sweep.positions, sweep.metric) == ([0, 1, 2], resolved, "logit_diff")
        torch.testing.assert_close(sweep.values, values, atol=1e-4, rtol=1e-4)
        assert sweep.clean == pytest.approx(clean, abs=1e-4) and sweep.corrupt == pytest.approx(corrupt, abs=1e-4)
    assert not torch.allclose(values, torch.full_like(values, corrupt))  # some cell moved the metric
    frame = on_vllm.frame()
    assert list(frame.index) == [0, 1, 2] and frame.shape == (3, len(resolved))


def test_recovered_and_logprob_sweeps_and_the_heat_map(path, steered, tmp_path):
    tokenizer = steered.get_tokenizer()
    token = tokenizer(" M", add_special_tokens=False)["input_ids"][0]
    measured = patch_sweep(steered, CLEAN, CORRUPT, layers=[1], positions=[-1, 3], metric=Logprob(token))
    recovered = patch_sweep(steered, CLEAN, CORRUPT, layers=[1], positions=[-1, 3], metric=Recovered(Logprob(token)))
    expected = (measured.values - measured.corrupt) / (measured.clean - measured.corrupt)
    torch.testing.assert_close(recovered.values, expected, atol=1e-5, rtol=1e-5)
    assert (recovered.clean, recovered.corrupt, recovered.metric) == (1.0, 0.0, "recovered_logprob")
    assert recovered.measured["clean"] == pytest.approx(measured.clean)
    figure = recovered.display(file=tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0 and figure.axes


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"metric": None}, "give a metric"),
        ({"metric": LogitDiff(10**6, 3)}, r"token 1000000 is not in the vocabulary \(ids 0..511\)"),
        ({"metric": Logprob("two words")}, r"'two words' is \d+ tokens"),
        ({"metric": Logprob(3), "corrupt": "short"}, "the clean prompt is .* tokens and the corrupt one"),
        ({"metric": Logprob(3), "value": "logits"}, "value must be one of"),
        ({"metric": Logprob(3), "layers": [7]}, r"layer\(s\) \[7\] do not exist"),
        ({"metric": Logprob(3), "positions": [99]}, r"position\(s\) \[99\] are outside"),
    ],
)
def test_bad_sweeps_are_refused_before_any_run(steered, arguments, message):
    requests = steered.request_counter.counter
    with pytest.raises(ValueError, match=message):
        patch_sweep(steered, CLEAN, arguments.pop("corrupt", CORRUPT), **arguments)
    assert steered.request_counter.counter == requests


def test_a_patch_shares_the_prompts_cached_blocks_before_its_position(path, steered):
    """A cell patched at position ``p`` computes the tokens before ``p`` as the unpatched prompt does: it reads the
    prefix cache's blocks before the one holding ``p`` (and only those), and its output still equals a hook's."""
    from test_steering import BLOCK

    prompt = "Patching changes nothing before its position: " + "block after block of tokens. " * 5
    ids = steered.get_tokenizer()(prompt)["input_ids"]
    assert len(ids) > 3 * BLOCK
    steered.reset_prefix_cache()
    (plain,) = steered.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY))
    assert plain.num_cached_tokens == 0
    position = 2 * BLOCK + 5
    patch = Patch(rows(1, steered.hidden_size, 7)[0], layers=1, positions=[position])
    (patched,) = steered.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY), [patch])
    assert patched.num_cached_tokens == 2 * BLOCK  # the blocks before the one holding the position
    tokens, logprobs = tokens_and_logprobs(patched)
    expected, expected_logprobs = hooked_patch_generation(path, ids, [patch])
    assert tokens == expected
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-4, rtol=1e-4)
    (again,) = steered.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY), [patch])
    assert again.num_cached_tokens > 2 * BLOCK  # the same patch shares its own blocks too
    earlier = Patch(rows(1, steered.hidden_size, 8)[0], layers=1, positions=[BLOCK + 1])
    (other,) = steered.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY), [earlier])
    assert other.num_cached_tokens == BLOCK


# -- probes and gates ---------------------------------------------------------------------------------------------


def hooked_streams(path, ids: list[int], layers: list[int]) -> dict[int, torch.Tensor]:
    """Each block's output ``[tokens, hidden]`` of transformers' own model on ``ids`` (forward hooks)."""
    return reference.block_outputs(reference.load(path), ids, layers)


def test_probes_read_each_token_as_h_at_w_plus_b(path, steered):
    """Probes read per token in the engine (one score, several classes with a softmax, prompt and generated tokens,
    the last position) equal ``h @ w + b`` of transformers' own block outputs over the same tokens."""
    hidden = steered.hidden_size
    generator = torch.Generator().manual_seed(11)
    one = Probe(torch.randn(hidden, generator=generator), bias=0.5, layer=1)
    three = Probe(torch.randn(hidden, 3, generator=generator), bias=[0.1, -0.2, 0.3], layer=2, activation="softmax")
    last = Probe(torch.randn(hidden, generator=generator), layer=0, positions="last", activation="sigmoid")
    probes = {"one": one, "three": three, "last": last}
    (output,) = steered.generate(reference.PROMPT, SamplingParams(**GREEDY), probes=probes)
    ids = steered.get_tokenizer()(reference.PROMPT)["input_ids"]
    fed = ids + list(output.outputs[0].token_ids)[:-1]  # every token that went through the model
    streams = hooked_streams(path, fed, [0, 1, 2])
    torch.testing.assert_close(output.probes["one"], streams[1] @ one.weight[:, 0] + 0.5, atol=1e-4, rtol=1e-4)
    expected = (streams[2] @ three.weight + three.bias).softmax(-1)
    torch.testing.assert_close(output.probes["three"], expected, atol=1e-4, rtol=1e-4)
    expected_last = (streams[0][len(ids) - 1 : len(ids)] @ last.weight[:, 0]).sigmoid()
    torch.testing.assert_close(output.probes["last"], expected_last, atol=1e-4, rtol=1e-4)
    assert output.outputs[0].probes is output.probes


def plain_ids(prompt: str) -> torch.Tensor:
    """``prompt``'s token ids, ``[1, tokens]``."""
    return tiny.tokenizer()(prompt, return_tensors="pt")["input_ids"]


def half_open_gate(path, ids: list[int], probe_layer: int) -> tuple[torch.Tensor, Probe, float]:
    """A vector, a probe reading block ``probe_layer`` and a threshold halfway between its two middle reads on
    ``ids``: about half the prompt passes, and no token's read sits on the threshold, where engines rounding
    differently could decide it apart."""
    generator = torch.Generator().manual_seed(12)
    hidden = tiny.config_kwargs("llama")["hidden_size"]
    vector = torch.randn(hidden, generator=generator) * 2
    probe = Probe(torch.randn(hidden, generator=generator), layer=probe_layer)
    streams = hooked_streams(path, ids, [probe_layer])
    reads = (streams[probe_layer] @ probe.weight[:, 0]).sort().values
    middle = len(reads) // 2
    return vector, probe, float(reads[middle - 1 : middle + 1].mean())


def gated_addition_hooks(
    model, vector: torch.Tensor, probe: Probe, threshold: float, layer: int
) -> tuple[list, dict[str, torch.Tensor]]:
    """Forward hooks on transformers' own ``model`` adding ``vector`` at block ``layer``'s output only on the tokens
    whose ``probe`` (read at its block's output, before anything is added there) exceeds ``threshold``: the handles,
    and what they saw (``"stream"``: block ``layer``'s output as steered, at the last forward)."""
    blocks = reference.blocks(model)
    gate = {}

    def read(module, args, out):
        stream = out[0] if isinstance(out, tuple) else out
        gate["open"] = (stream[0] @ probe.weight[:, 0] + probe.bias[0]) > threshold

    def add(module, args, out):
        stream = (out[0] if isinstance(out, tuple) else out).clone()
        stream[0, gate["open"]] += vector
        gate["stream"] = stream
        return (stream, *out[1:]) if isinstance(out, tuple) else stream

    return [blocks[probe.layer].register_forward_hook(read), blocks[layer].register_forward_hook(add)], gate


def hooked_gated_generation(path, ids: list[int], vector: torch.Tensor, probe: Probe, threshold: float, layer: int):
    """Greedy tokens and logprobs of transformers' own model with `gated_addition_hooks`."""
    model = reference.load(path)
    handles, _ = gated_addition_hooks(model, vector, probe, threshold, layer)
    return reference.greedy_with_hooks(model, ids, handles, STEPS)


def hooked_gated_forward(path, ids: list[int], vector: torch.Tensor, probe: Probe, threshold: float, layer: int):
    """Block ``layer``'s output and the logits of one forward of transformers' own model over ``ids`` with
    `gated_addition_hooks`."""
    model = reference.load(path)
    handles, seen = gated_addition_hooks(model, vector, probe, threshold, layer)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits
    finally:
        for handle in handles:
            handle.remove()
    return seen["stream"], logits


@pytest.mark.parametrize("probe_layer", [0, 2])
def test_steering_gated_by_a_probe_acts_only_where_it_fires(path, steered, probe_layer):
    """`Steering(..., when=(probe, ">", t))` equals a hook adding the vector only where the probe, read at a block
    at or before the spec's, passes; the ungated spec moves every token."""
    ids = steered.get_tokenizer()(reference.PROMPT)["input_ids"]
    vector, probe, threshold = half_open_gate(path, ids, probe_layer)
    gated = Steering(2, vector, when=(probe, ">", threshold))
    (output,) = steered.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY), [gated])
    tokens, logprobs = tokens_and_logprobs(output)
    expected, expected_logprobs = hooked_gated_generation(path, ids, vector, probe, threshold, 2)
    assert tokens == expected
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-4, rtol=1e-4)
    (ungated,) = steered.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY), [Steering(2, vector)])
    assert tokens_and_logprobs(ungated)[0] != tokens or not torch.allclose(tokens_and_logprobs(ungated)[1], logprobs)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda n: {"p": Probe(torch.ones(7))}, "weight is 7 wide; this model's stream is 128"),
        (lambda n: {"p": Probe(torch.ones(n), layer=5)}, r"layer\(s\) \[5\] do not exist"),
        (lambda n: {"p": Probe(torch.ones(n), positions=[400])}, r"position\(s\) \[400\] are outside"),
    ],
)
def test_bad_probes_are_refused_before_the_engine_sees_them(steered, make, message):
    requests = steered.request_counter.counter
    with pytest.raises(ValueError, match=message):
        steered.generate(reference.PROMPT, SamplingParams(max_tokens=2), probes=make(steered.hidden_size))
    assert steered.request_counter.counter == requests


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda n: Steering(0, torch.ones(n), when=(Probe(torch.ones(n), layer=2), ">", 0.0)), "when reads block 2"),
        (lambda n: Steering(0, torch.ones(n), when=(Probe(torch.ones(n, 2)), ">", 0.0)), "a gate reads one score"),
        (lambda n: Steering(0, torch.ones(n), when=(Probe(torch.ones(n)), "==", 0.0)), "when is .* op one of"),
        (lambda n: Ablate(torch.ones(n), when=(Probe(torch.ones(n)), ">", 0.0)), "before any block a gate"),
    ],
)
def test_bad_gates_are_refused_before_the_engine_sees_them(steered, make, message):
    requests = steered.request_counter.counter
    with pytest.raises(ValueError, match=message):
        steered.generate(reference.PROMPT, SamplingParams(max_tokens=2), make(steered.hidden_size))
    assert steered.request_counter.counter == requests
