"""Steering experiments on `SteeredVLLM`: a grid as one batch, its rows, its scores, decode-only prompt sharing.

One engine on a tiny llama with a 1024-token context (prefix caching on, vLLM's default steps, three direction slots
per block), shared by the tests.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import reference
import tiny
import torch
from test_experiments import CLEAN, CORRUPT
from vllm import SamplingParams

from nnterp_vllm import (
    SAE,
    Ablate,
    Cap,
    Clamp,
    Logprob,
    StandardizedTransformer,
    SteeredVLLM,
    Steering,
    patch_sweep,
    sweep,
)
from nnterp_vllm.display import plot_sweep_scores
from nnterp_vllm.steering.sweeps import COLUMNS, read_grid, scoring_positions

GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
PROMPTS = ["The weather today is", "My favourite colour is"]
TARGETS = {"A": " (A) yes", "B": " (B) no"}
LONG = "".join(f"{i % 10} " for i in range(300))  # 600 tokens of the byte-level tokenizer


@pytest.fixture(scope="module")
def path():
    return tiny.checkpoint("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def engine(path):
    model = SteeredVLLM(
        path, dtype="float32", max_model_len=1024, disable_log_stats=False, steering_directions_per_block=3
    )
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def vectors():
    generator = torch.Generator().manual_seed(3)
    return {name: torch.randn(128, generator=generator) * 2 for name in ("up", "down")}


def hits(model: SteeredVLLM) -> float:
    return sum(metric.value for metric in model.get_metrics() if metric.name == "vllm:prefix_cache_hits")


def test_a_grid_of_decode_only_steerings_computes_its_prompt_once(engine, vectors):
    generator = torch.Generator().manual_seed(4)
    grid = {f"v{i}": torch.randn(128, generator=generator) for i in range(4)}
    tokens = len(engine.get_tokenizer()(LONG)["input_ids"])
    assert 550 < tokens < 1000
    before = hits(engine)
    table = sweep(engine, [LONG], grid, [1], [0.5, 1.0, 2.0, 4.0], SamplingParams(**GREEDY), positions="generated")
    assert len(table) == 17  # the baseline and 16 cells
    full_blocks = tokens // engine.llm_engine.vllm_config.cache_config.block_size
    # the prompt's full blocks computed once, before the grid: its 17 requests all read them
    assert hits(engine) - before >= 17 * full_blocks * engine.llm_engine.vllm_config.cache_config.block_size
    for row in table[1:5]:  # each row equals the same steering run alone
        specs = [Steering(row["layers"], grid[row["vector"]], row["factor"], "generated")]
        (alone,) = engine.generate(LONG, SamplingParams(**GREEDY), specs)
        assert row["token_ids"] == list(alone.outputs[0].token_ids)


def test_rows_equal_separate_generate_calls_and_scores_equal_transformers(engine, vectors, path, tmp_path):
    params = SamplingParams(**GREEDY)
    table = sweep(engine, PROMPTS, vectors, [0, [1, 2]], [-1.0, 3.0], params, score=TARGETS, positions="generated")
    assert len(table) == len(PROMPTS) * (1 + 2 * 2 * 2)
    assert set(table[0]) == {*COLUMNS, "score: A", "score: B"}
    assert (table[0]["vector"], table[0]["factor"], table[0]["layers"]) == (None, 0.0, None)
    frame = table.frame
    assert list(frame.columns[: len(COLUMNS)]) == list(COLUMNS) and len(frame) == len(table)
    hf = StandardizedTransformer(path)
    for row in table:
        specs = (
            None
            if row["vector"] is None
            else [Steering(row["layers"], vectors[row["vector"]], row["factor"], "generated")]
        )
        assert_generated_alone_and_scored_as_transformers(engine, hf, row, specs)
    assert len({row["score: A"] for row in table if row["prompt"] == PROMPTS[0]}) > 1  # steering moves the scores
    figure = plot_sweep_scores(table, "A", file=tmp_path / "scores.png")
    assert (tmp_path / "scores.png").stat().st_size > 0 and len(figure.axes[0].lines) == 5  # 4 cells and baseline
    assert len(table.to_jsonl(tmp_path / "rows.jsonl").read_text().splitlines()) == len(table)


def assert_generated_alone_and_scored_as_transformers(engine, hf, row: dict, specs) -> None:
    """A sweep's row equals ``specs`` run alone on the engine, and each score transformers' under ``specs``."""
    (alone,) = engine.generate(row["prompt"], SamplingParams(**GREEDY), specs)
    assert row["token_ids"] == list(alone.outputs[0].token_ids) and row["text"] == alone.outputs[0].text
    for label, target in TARGETS.items():
        torch.testing.assert_close(
            torch.tensor(row[f"score: {label}"]),
            transformers_logprob(hf, row["prompt"], target, specs),
            atol=1e-3,
            rtol=1e-4,
        )


def transformers_logprob(model: StandardizedTransformer, prompt: str, target: str, specs) -> torch.Tensor:
    """The summed log-probability of ``target`` after ``prompt``, each spec applied where the model would apply it
    to a generated ``target``: the target's positions."""
    prompt_ids = model.tokenizer(prompt)["input_ids"]
    target_ids = model.tokenizer(target, add_special_tokens=False)["input_ids"]
    where = scoring_positions("generated", len(prompt_ids), len(target_ids))
    with model.trace(prompt_ids + target_ids):  # in the order the blocks run; an ablation everywhere last
        for spec in sorted(specs or [], key=lambda spec: (spec.layers == "all", spec.layers)):
            for layer in [spec.layers] if spec.layers == "all" else spec.layers:
                reference.intervene(model, layer, spec, where)
        logits = model.logits.save()
    logprobs = torch.log_softmax(logits[0].float(), -1)
    return sum(logprobs[len(prompt_ids) + i - 1, token] for i, token in enumerate(target_ids))


def test_caps_clamps_and_ablations_sweep_by_their_bounds_and_values_and_score_as_transformers(
    engine, vectors, path, tmp_path
):
    reference.saelens_sae(tmp_path / "sae", "standard", "blocks.1.hook_resid_post", 128, seed=5, stream_scale=0.07)
    sae = SAE.load(tmp_path / "sae")
    grid = {
        "ablated": Ablate(vectors["up"]),  # every residual-stream location; no factor changes it
        "capped": Cap(vectors["down"], layers=[1, 2], max=0.02),
        "clamped": [  # three features of one SAE at its block: the engine's three direction slots
            Clamp(sae, 3, value=4.0),
            Clamp(sae, 7, scale=0.5),
            Clamp(sae, 11, value=-1.0),
            Steering(0, vectors["up"], factor=0.5),
        ],
    }
    params = SamplingParams(**GREEDY)
    table = sweep(engine, PROMPTS, grid, [], [1.0, -2.0], params, score=TARGETS, positions="generated")
    assert len(table) == len(PROMPTS) * (1 + 1 + 2 + 2)
    cells = {(row["vector"], row["factor"]): row["layers"] for row in table}
    assert cells == {
        (None, 0.0): None,
        ("ablated", None): "all",
        **{("capped", factor): [1, 2] for factor in (1.0, -2.0)},
        **{("clamped", factor): [0, 1] for factor in (1.0, -2.0)},
    }
    expected = {  # each cell's specs, written out: a cap's bounds and a clamp's value times the factor
        ("ablated", None): [Ablate(vectors["up"], positions="generated")],
        ("capped", 1.0): [Cap(vectors["down"], [1, 2], max=0.02, positions="generated")],
        ("capped", -2.0): [Cap(vectors["down"], [1, 2], min=-0.04, positions="generated")],
        **{
            ("clamped", factor): [
                Clamp(sae, 3, 4.0 * factor, positions="generated"),
                Clamp(sae, 7, scale=0.5 * factor, positions="generated"),
                Clamp(sae, 11, -1.0 * factor, positions="generated"),
                Steering(0, vectors["up"], 0.5 * factor, "generated"),
            ]
            for factor in (1.0, -2.0)
        },
    }
    hf = StandardizedTransformer(path)
    for row in table:
        specs = expected.get((row["vector"], row["factor"]))
        assert_generated_alone_and_scored_as_transformers(engine, hf, row, specs)
    baseline = {row["prompt"]: row["score: A"] for row in table if row["vector"] is None}
    for name in ("ablated", "capped", "clamped"):  # each kind moves the scores off the baseline
        assert any(abs(row["score: A"] - baseline[row["prompt"]]) > 1e-3 for row in table if row["vector"] == name)
    figure = plot_sweep_scores(table, "A")
    assert len(figure.axes[0].lines) == 4  # the cap's and the clamp's lines, the ablation's level, the baseline


@pytest.mark.slow
def test_the_cli_runs_a_grid_file_to_json_lines(path, vectors, tmp_path):
    torch.save({"layer_activations": {1: vectors["up"]}, "layer_type": "decoder_block"}, tmp_path / "up.pt")
    grid = {
        "prompts": PROMPTS,
        "vectors": {"up": "up.pt", "inline": vectors["down"].tolist()},
        "layers": [2],
        "factors": [1.0, 2.0],
        "sampling": GREEDY,
        "score": [" yes"],
        "engine": {"dtype": "float32", "max_model_len": 1024},
    }
    (tmp_path / "grid.json").write_text(json.dumps(grid))
    command = [sys.executable, "-m", "nnterp_vllm.cli", "sweep", str(path), "--grid", str(tmp_path / "grid.json")]
    done = subprocess.run([*command, "--out", str(tmp_path / "rows.jsonl"), "--quiet"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == len(PROMPTS) * (1 + 2 * 2) and all("score:  yes" in row for row in rows)
    assert {(row["vector"], tuple(row["layers"] or ())) for row in rows} == {(None, ()), ("up", (1,)), ("inline", (2,))}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"prompts": []}, "prompts must be a non-empty list"),
        ({"vectors": {}}, "vectors must be a non-empty dict"),
        ({"factors": []}, "factors must be a non-empty list"),
        ({"factors": [float("nan")]}, "factor must be a finite number"),
        ({"layers": []}, "layers must be a non-empty list"),
        ({"layers": [7]}, r"layer\(s\) \[7\] do not exist"),
        ({"score": {"A": ""}}, "score must be a non-empty dict"),
        ({"vectors": {"v": torch.zeros(5)}}, r"shape \[hidden_size\] = \[128\]"),
        (
            {"vectors": {"v": [Ablate(torch.ones(128), layers=1)] * 4}},
            r"4 directions on the same tokens at layer 1; the engine applies at most 3 per token there",
        ),
    ],
)
def test_a_bad_grid_is_refused_before_the_engine_sees_it(engine, vectors, change, message):
    arguments = {"prompts": PROMPTS, "vectors": vectors, "layers": [1], "factors": [1.0], "score": None, **change}
    requests = engine.request_counter.counter
    with pytest.raises(ValueError, match=message):
        sweep(engine, sampling_params=SamplingParams(**GREEDY), **arguments)
    assert engine.request_counter.counter == requests


def test_a_patch_sweep_of_a_value_the_engine_does_not_keep_is_refused_before_any_run(engine):
    requests = engine.request_counter.counter
    with pytest.raises(ValueError, match=r"this engine keeps none of them: build it with capture_values"):
        patch_sweep(engine, CLEAN, CORRUPT, metric=Logprob(3), value="mlp_output")
    assert engine.request_counter.counter == requests


def test_a_bad_grid_file_names_the_file_and_the_key(tmp_path):
    (tmp_path / "grid.yaml").write_text("prompts: [a]\nvectors: {v: [1.0]}\nfactor: [1]\n")
    with pytest.raises(ValueError, match=r"grid.yaml: unknown keys \['factor'\] / missing keys \['factors'\]"):
        read_grid(tmp_path / "grid.yaml")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        read_grid(tmp_path / "bad.json")
    (tmp_path / "vector.json").write_text(json.dumps({"prompts": ["a"], "vectors": {"v": 3}, "factors": [1]}))
    with pytest.raises(ValueError, match="vectors.v is a list of floats, a file path"):
        read_grid(tmp_path / "vector.json")


def test_a_grid_file_gives_specs_by_kind_and_refuses_a_bad_one_naming_the_entry(tmp_path):
    reference.saelens_sae(tmp_path / "sae", "standard", "blocks.1.hook_resid_post", 8)
    entries = {
        "off": {"kind": "ablate", "vector": [1.0] + [0.0] * 7},
        "low": {"kind": "cap", "vector": [0.0, 2.0] + [0.0] * 6, "layers": [1], "max": 0.5},
        "feature": {"kind": "clamp", "sae": "sae", "feature": 3, "scale": 2.0},
        "up": {"kind": "add", "vector": [1.0] * 8, "layers": 2, "factor": 3.0},
    }
    (tmp_path / "grid.yaml").write_text(json.dumps({"prompts": ["a"], "vectors": entries, "factors": [1]}))
    read = read_grid(tmp_path / "grid.yaml")["vectors"]
    assert isinstance(read["off"], Ablate) and read["off"].layers == "all" and read["off"].vector[0] == 1.0
    low = read["low"]
    assert isinstance(low, Cap) and (low.layers, low.max, float(low.vector[1])) == ([1], 0.5, 1.0)
    assert (read["feature"].sae.layer, read["feature"].feature, read["feature"].scale) == (1, 3, 2.0)
    assert isinstance(read["up"], Steering) and (read["up"].layers, read["up"].factor) == ([2], 3.0)
    for entry, message in [
        (
            {"kind": "steer", "vector": [1.0]},
            "vectors.bad.kind must be one of add, ablate, cap, clamp, patch, got 'steer'",
        ),
        ({"kind": "cap", "vector": [1.0], "layers": [1], "factor": 2}, r"vector, layers, min, max, not \['factor'\]"),
        ({"kind": "cap", "vector": [1.0], "layers": [1]}, "vectors.bad: Cap: give min, max or both"),
        ({"kind": "clamp", "sae": "nowhere", "feature": 0, "value": 1.0}, "vectors.bad: .*nowhere"),
    ]:
        (tmp_path / "bad.json").write_text(json.dumps({"prompts": ["a"], "vectors": {"bad": entry}, "factors": [1]}))
        with pytest.raises(ValueError, match=message):
            read_grid(tmp_path / "bad.json")
