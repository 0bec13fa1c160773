"""Relative steering factors (``Steering(..., scale="relative")``: ``h + f * |h| * v / |v|``) on both engines and
over HTTP, against plain transformers with forward hooks written here (the norm of the block's output before any
edit at it, float32, over the hidden dimension).

One compiled `SteeredVLLM` (tiny llama, float32) generates every case in one continuous batch: absolute, relative,
both at one block (the relative one then takes a direction slot of the pool entry), listed positions, phases, a gate
and a cap after the additions, beside unsteered requests; then it is shut down and one ``nnterp-vllm serve`` starts
with ``--max-relative-dose``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import reference
import tiny
import torch
from test_serve import ENGINE, Server
from vllm import SamplingParams

from nnterp_vllm import Ablate, Cap, Probe, StandardizedTransformer, SteeredVLLM, Steering, contrast_steering
from nnterp_vllm.specs.steering_requests import request_steering
from nnterp_vllm.steering.sweeps import grid_spec

STEPS = 10
HIDDEN = tiny.SIZES["hidden_size"]
#: Logprobs of the same tokens on two engines, fp32 (fused kernels round differently).
LOGPROB_TOLERANCE = {"atol": 2e-4, "rtol": 1e-4}
PROMPT = "The quick brown fox"
#: The server's bound on a relative factor's magnitude.
DOSE = 0.75
MODEL = "tiny"


def vectors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randn(HIDDEN, generator=generator) * (i + 1) for i in range(6)]


def gate_probe(vector: torch.Tensor) -> Probe:
    """A probe at block 1 that fires on some tokens of the tiny model's stream and not on others."""
    return Probe(vector / vector.norm(), 0.0, 1)


def cases() -> dict[str, list | None]:
    v = vectors()
    return {
        "relative": [Steering(1, v[0], factor=0.5, scale="relative")],
        "relative prompt, two blocks": [Steering([0, 2], v[1], factor=-0.4, scale="relative", positions="prompt")],
        "relative generated, absolute elsewhere": [
            Steering(2, v[2], factor=0.6, scale="relative", positions="generated"),
            Steering(0, v[3], factor=0.2),
        ],
        "relative and absolute at one block": [
            Steering(1, v[4], factor=0.5, scale="relative"),
            Steering(1, v[5], factor=0.3),
        ],
        "relative at listed positions": [Steering(1, v[0], factor=0.8, scale="relative", positions=[0, -1])],
        "absolute": [Steering(0, v[1], factor=0.5)],
        "unsteered": None,
        "gated relative": [Steering(1, v[2], factor=0.7, scale="relative", when=(gate_probe(v[3]), ">", 0.0))],
        "two relative and a cap": [
            Steering(2, v[3], factor=0.3, scale="relative"),
            Steering(2, v[4], factor=-0.5, scale="relative"),
            Cap(v[5], layers=2, max=0.0),
        ],
    }


def prompt_ids(i: int) -> list[int]:
    words = ["The quick brown fox", "A cup of coffee", "Rome was built", "Quantum computers", "My favourite book"]
    text = f"{words[i % len(words)]} (note {i}) is" + " and so on," * (i % 3)
    return tiny.tokenizer()(text)["input_ids"]


def hooked_edit(
    specs: list, layer: int, num_layers: int, stream: torch.Tensor, phase: str, unedited: dict[int, torch.Tensor]
) -> torch.Tensor:
    """Block ``layer``'s output ``stream`` (``[seq, hidden]``) with ``specs`` applied as the library documents them,
    written out here: each addition at its tokens (relative: ``f * |h| * v / |v|``, ``h`` the output before any edit
    at this block), then each cap; a gate reads its probe's block's output before any edit there (``unedited``, by
    block, this one's recorded here)."""
    original = unedited[layer] = stream
    stream = stream.clone()
    norm = original.float().norm(dim=-1, keepdim=True)

    def tokens(spec) -> list[int]:
        if layer not in [chosen % num_layers for chosen in spec.layers]:
            return []
        if spec.positions in ("all", phase):
            rows = list(range(stream.shape[0]))
        elif phase == "prompt" and not isinstance(spec.positions, str):
            rows = sorted({position % stream.shape[0] for position in spec.positions})
        else:
            return []
        if spec.when is not None:
            probe, _, threshold = spec.when
            scores = unedited[probe.layer] @ probe.weight[:, 0] + probe.bias[0]
            rows = [row for row in rows if scores[row] > threshold]
        return rows

    for spec in specs:
        if isinstance(spec, Steering) and (rows := tokens(spec)):
            if spec.scale == "relative":
                stream[rows] += spec.factor * norm[rows] * spec.vector / spec.vector.norm()
            else:
                stream[rows] += spec.factor * spec.vector
    for spec in specs:
        if isinstance(spec, Cap) and (rows := tokens(spec)):
            unit = spec.vector
            projection = stream[rows] @ unit
            stream[rows] += (projection.clamp(spec.min, spec.max) - projection)[:, None] * unit
    return stream


def hooks(model, specs: list) -> list:
    """Forward hooks on transformers' own blocks applying ``specs``; the first call of a block is the prompt."""
    calls: dict[int, int] = {}
    unedited: dict[int, torch.Tensor] = {}
    num_layers = model.config.num_hidden_layers

    def hook(layer: int):
        def edit(module, args, out):
            hidden = out[0] if isinstance(out, tuple) else out
            phase = "prompt" if calls.get(layer, 0) == 0 else "generated"
            calls[layer] = calls.get(layer, 0) + 1
            edited = hooked_edit(specs, layer, num_layers, hidden[0], phase, unedited)[None]
            return (edited, *out[1:]) if isinstance(out, tuple) else edited

        return edit

    return [block.register_forward_hook(hook(i)) for i, block in enumerate(reference.blocks(model))]


def hooked_logits(model, specs: list, ids: list[int]) -> torch.Tensor:
    """The prompt's logits from transformers' own model with `hooks` applying ``specs`` (removed after)."""
    handles = hooks(model, specs)
    try:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0]
    finally:
        for handle in handles:
            handle.remove()


def tokens_and_logprobs(output) -> tuple[list[int], torch.Tensor]:
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    return tokens, torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, tokens)])


@pytest.fixture(scope="module")
def steered(tmp_path_factory):
    """Every case on one compiled SteeredVLLM, in one batch, then what the server must answer; the engine shut
    down before the server starts."""
    path = tiny.checkpoint("llama")
    found = cases()
    prompts = [{"prompt_token_ids": prompt_ids(i)} for i in range(len(found))]
    per_layer = {0: vectors()[2], 2: vectors()[4]}
    served = {
        "inline": [Steering(1, vectors()[0], factor=0.5, scale="relative"), Steering(1, vectors()[1], factor=0.2)],
        "per layer": [Steering(layer, vector, factor=-0.6, scale="relative") for layer, vector in per_layer.items()],
        "absolute beyond the dose": [Steering(1, vectors()[0], factor=3.0)],
    }
    llm = SteeredVLLM(path, **ENGINE)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
        outputs = llm.generate(prompts, params, list(found.values()), use_tqdm=False)
        stats = llm.steering_stats()[0]
        answers = llm.generate([PROMPT] * len(served), params, list(served.values()), use_tqdm=False)
    finally:
        llm.shutdown()
    yield SimpleNamespace(
        path=path,
        cases=found,
        prompts=[prompt["prompt_token_ids"] for prompt in prompts],
        outputs=dict(zip(found, (tokens_and_logprobs(output) for output in outputs))),
        stats=stats,
        served=served,
        per_layer=per_layer,
        answers=dict(zip(served, (list(output.outputs[0].token_ids) for output in answers))),
        directory=tmp_path_factory.mktemp("relative"),
    )


def test_relative_factors_in_the_compiled_engine_equal_transformers_hooks(steered):
    """Every case of the batch (relative and absolute specs of different requests in the same steps) gives the
    greedy tokens and logprobs of transformers' model with the formula applied by hooks; the steering ran inside
    the compiled graph, never as Python."""
    model = reference.load(steered.path)
    plain = steered.outputs["unsteered"][0]
    for (name, specs), ids in zip(steered.cases.items(), steered.prompts):
        expected = reference.greedy_with_hooks(model, ids, hooks(model, specs or []), STEPS)
        tokens, logprobs = steered.outputs[name]
        assert tokens == expected[0], name
        torch.testing.assert_close(logprobs, expected[1], **LOGPROB_TOLERANCE, msg=name)
    changed = [name for name, (tokens, _) in steered.outputs.items() if name != "unsteered" and tokens != plain]
    assert len(changed) >= 5, changed  # the factors move the tiny model's answers
    assert steered.stats["eager_calls"] == 0 and steered.stats["entry_writes"] >= 8


def test_relative_factors_on_standardized_transformer_equal_the_hooks():
    """``model.steer(..., scale="relative")`` in a trace (the same specs' fields, gate included) gives the logits of
    transformers' model with the hooks; a [n, hidden] vector is one direction per position."""
    specs = [
        Steering(0, vectors()[0], factor=0.3, scale="relative"),
        Steering(1, vectors()[1], factor=0.5, scale="relative", positions=[1, -1]),
        Steering(1, vectors()[2], factor=0.4),
        Steering(2, vectors()[3], factor=-0.6, scale="relative", when=(gate_probe(vectors()[4]), ">", 0.0)),
    ]
    ids = prompt_ids(3)
    path = tiny.checkpoint("llama")
    plain = reference.load(path)
    expected = hooked_logits(plain, specs, ids)
    model = StandardizedTransformer(path)
    with model.trace({"input_ids": torch.tensor([ids])}):
        for spec in specs:
            at = None if spec.positions == "all" else spec.positions
            model.steer(spec.layers, spec.vector, spec.factor, positions=at, when=spec.when, scale=spec.scale)
        logits = model.logits.save()
    torch.testing.assert_close(logits[0], expected, atol=1e-5, rtol=1e-5)
    rows = torch.stack([vectors()[0], -3 * vectors()[5]])
    with model.trace({"input_ids": torch.tensor([ids])}):
        model.steer(1, rows, 0.5, positions=[0, 2], scale="relative")
        per_row = model.logits.save()
    split = [Steering(1, row, factor=0.5, scale="relative", positions=[p]) for row, p in zip(rows, [0, 2])]
    torch.testing.assert_close(per_row[0], hooked_logits(plain, split, ids), atol=1e-5, rtol=1e-5)


def test_relative_specs_are_checked_as_they_are_made_and_keep_their_scale():
    v = vectors()[0]
    with pytest.raises(ValueError, match=r"scale must be 'absolute' .* or 'relative' .*got 'norm'"):
        Steering(1, v, scale="norm")
    with pytest.raises(ValueError, match="nonzero, finite norm"):
        Steering(1, torch.zeros(HIDDEN), scale="relative")
    spec = Steering(1, v, factor=0.5, scale="relative")
    assert spec.scaled(2.0).scale == "relative" and spec.scaled(2.0).factor == 1.0
    assert spec.at_positions("generated").scale == "relative"
    wire = spec.resolved(3, HIDDEN, 4)
    assert wire["scale"] == "relative" and math.isclose(torch.tensor(wire["vector"]).norm().item(), 1.0, rel_tol=1e-6)
    assert "scale" not in Steering(1, v).resolved(3, HIDDEN, 4)  # an absolute spec's engine form is as it was
    with pytest.raises(ValueError, match="got None"):
        Steering(1, v, scale=None)
    grid = grid_spec(Path("grid.yaml"), "v", {"kind": "add", "vector": v.tolist(), "layers": 1, "scale": "relative"})
    assert grid.scale == "relative" and grid.factor == 1.0
    with pytest.raises(ValueError, match=r"contrast_steering: scale must be"):
        contrast_steering("unused", ["a"], ["b"], layers=1, scale="norm")  # refused before anything loads


def test_a_relative_addition_beside_an_absolute_one_takes_a_direction_slot():
    """At one block an entry holds one added vector of one scale: a relative addition beside an absolute one (or a
    patch) takes a direction slot, counted against the engine's slots per block and refused past them."""
    v = vectors()
    alone = [Steering(1, v[0], 0.5, scale="relative"), Steering(1, v[1], 0.2, scale="relative")]
    alone += [Ablate(v[2], 1), Ablate(v[3], 1)]
    assert request_steering(alone, 3, HIDDEN, 6) is not None  # two relative additions share the added vector
    mixed = [Steering(1, v[0], 0.5, scale="relative"), Steering(1, v[1], 0.2), Ablate(v[2], 1), Ablate(v[3], 1)]
    with pytest.raises(ValueError, match=r"specs \[0, 2, 3\] cap, ablate or clamp 3 directions .*additions \[0\]"):
        request_steering(mixed, 3, HIDDEN, 6)
    assert request_steering(mixed, 3, HIDDEN, 6, directions_per_block=3) is not None


def test_steer_refuses_a_bad_scale_and_a_zero_direction():
    model = StandardizedTransformer(tiny.checkpoint("llama"))
    with pytest.raises(ValueError, match=r"steer: scale must be 'absolute'"):
        with model.trace(PROMPT):
            model.steer(1, vectors()[0], 0.5, scale="percent")
    with pytest.raises(ValueError, match=r"steer \(scale='relative'\).*nonzero, finite norm"):
        with model.trace(PROMPT):
            model.steer(1, torch.zeros(HIDDEN), 0.5, scale="relative")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-relative-dose=0"], "--max-relative-dose must be a finite number > 0"),
        (["--max-relative-dose=-0.5"], "--max-relative-dose must be a finite number > 0"),
        (["--max-relative-dose=inf"], "--max-relative-dose must be a finite number > 0"),
        (["--max-relative-dose=nan"], "--max-relative-dose must be a finite number > 0"),
    ],
)
def test_a_bad_relative_dose_bound_is_refused_as_the_command_line_is_read(flags, message):
    from nnterp_vllm.serve.command_line import parse

    with pytest.raises(ValueError, match=message):
        parse([str(tiny.checkpoint("llama")), *flags])
    assert parse([str(tiny.checkpoint("llama")), "--max-relative-dose", "0.25"]).max_relative_dose == 0.25
    assert parse([str(tiny.checkpoint("llama"))]).max_relative_dose is None


@pytest.fixture(scope="module")
def server(steered):
    arguments = [str(steered.path), "--served-model-name", MODEL, "--max-relative-dose", str(DOSE)]
    arguments += [f"--{key.replace('_', '-')}={value}" for key, value in ENGINE.items()]
    started = Server(arguments, steered.directory / "server.log")
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()


def completion(server, steering, model: str = MODEL) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}
    body |= {"return_token_ids": True} | ({} if steering is None else {"steering": steering})
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def wire(spec: Steering) -> dict:
    return {"layers": spec.layers, "vector": spec.vector.tolist(), "factor": spec.factor, "scale": spec.scale}


def test_relative_specs_over_http_equal_the_steered_engines_answer(steered, server):
    """An inline relative spec beside an absolute one, and a vector registered per layer sent with a relative
    scale, answer as `SteeredVLLM` does; an absolute spec is not bounded by --max-relative-dose."""
    response = completion(server, [wire(spec) for spec in steered.served["inline"]])
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == steered.answers["inline"]
    vector = {str(layer): vector.tolist() for layer, vector in steered.per_layer.items()}
    registered = httpx.post(server.url + "/v1/steering/vectors", json={"name": "per-layer", "vector": vector})
    assert registered.status_code in (200, 201), registered.text
    response = completion(server, [{"vector": "per-layer", "factor": -0.6, "scale": "relative"}])
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == steered.answers["per layer"]
    response = completion(server, [wire(spec) for spec in steered.served["absolute beyond the dose"]])
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == steered.answers["absolute beyond the dose"]


def test_a_steered_models_relative_recipe_answers_as_the_engine_and_is_bounded_as_a_request(steered, server):
    """A steered model registered with a relative recipe answers as `SteeredVLLM` with those specs; a recipe whose
    relative factor exceeds --max-relative-dose is refused as a request's steering is."""
    recipe = [wire(spec) for spec in steered.served["inline"]]
    models = server.url + "/v1/steering/models"
    registered = httpx.post(models, json={"name": "relative-inline", "steering": recipe}, timeout=60)
    assert registered.status_code in (200, 201), registered.text
    response = completion(server, None, model="relative-inline")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == steered.answers["inline"]
    beyond = [{**recipe[0], "factor": 2 * DOSE}]
    refused = httpx.post(models, json={"name": "too-strong", "steering": beyond}, timeout=60)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "steering[0].factor" and "--max-relative-dose" in error["message"], error


@pytest.mark.parametrize(
    "steering, param, message",
    [
        ([{"scale": "percent"}], "steering[0].scale", r"scale must be one of 'absolute', 'relative'.*got 'percent'"),
        ([{"scale": 0.5}], "steering[0].scale", r"scale must be one of 'absolute', 'relative'.*got 0.5"),
        (
            [{}, {"factor": DOSE + 0.01, "scale": "relative"}],
            "steering[1].factor",
            rf"relative factor of {DOSE + 0.01}.*\|factor\| <= {DOSE} \(--max-relative-dose {DOSE}\)",
        ),
        (
            [{"factor": -1.0, "scale": "relative"}],
            "steering[0].factor",
            rf"\|factor\| <= {DOSE} \(--max-relative-dose {DOSE}\)",
        ),
        (
            [{"vector": "per-layer", "factor": 2.0, "scale": "relative"}],
            "steering[0].factor",
            "--max-relative-dose",
        ),
        ([{"vector": [0.0] * HIDDEN, "scale": "relative"}], "steering[0].vector", "nonzero, finite norm"),
        ([{"kind": "ablate", "scale": "relative"}], "steering[0].scale", "'ablate' specs have no field 'scale'"),
    ],
)
def test_a_bad_scale_or_a_dose_past_the_bound_is_refused_with_400_naming_the_field(server, steering, param, message):
    specs = [{"layers": 1, "vector": [0.5] * HIDDEN, **spec} for spec in steering]
    response = completion(server, specs)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error
    within = completion(server, [{"layers": 1, "vector": [0.5] * HIDDEN, "factor": -DOSE, "scale": "relative"}])
    assert within.status_code == 200, within.text
