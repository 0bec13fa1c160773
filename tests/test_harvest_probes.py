"""Probe scores harvested as values (``probes.NAME``): on either engine equal to ``h @ w + b`` of transformers' own
hidden states, in both layouts, recorded in the manifest, and bad probes refused before any work."""

from __future__ import annotations

import pytest
import tiny
import torch

from nnterp_vllm import Probe, StandardizedTransformer, load_harvest
from nnterp_vllm.cli import probes_given
from nnterp_vllm.harvest import HarvestError, harvest
from nnterp_vllm.harvest.in_engine import CAPTURE_ONLY, ENGINE_DEFAULTS

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards hex bold jumping zebras".split()
#: The probe columns of the shared engine: the probes below read four, one more is refused.
COLUMNS = 4


def documents(count: int, seed: int = 0) -> list[str]:
    """``count`` documents of 3..30 words, the fourth empty, deterministic."""
    generator = torch.Generator().manual_seed(seed)
    docs = []
    for i in range(count):
        length = 0 if i == 3 else int(torch.randint(3, 30, (1,), generator=generator))
        picks = torch.randint(0, len(WORDS), (length,), generator=generator).tolist()
        docs.append(" ".join(WORDS[j] for j in picks))
    return docs


def make_probes(hidden: int) -> dict[str, Probe]:
    """A one-score sigmoid probe at block 1 and a three-class softmax probe at block 0."""
    generator = torch.Generator().manual_seed(5)
    return {
        "one": Probe(torch.randn(hidden, generator=generator), bias=0.3, layer=1, activation="sigmoid"),
        "three": Probe(torch.randn(hidden, 3, generator=generator), bias=[0.1, -0.2, 0.3], activation="softmax"),
    }


VALUES = ["layers.1.layer_output", "probes.one", "probes.three"]


@pytest.fixture(scope="module")
def llama(llama_path):
    return StandardizedTransformer(llama_path)


@pytest.fixture(scope="module")
def engine(llama_path):
    """One engine for the module, built as a harvest reading these probes builds its own."""
    from nnterp_vllm import SteeredVLLM

    settings = {**ENGINE_DEFAULTS, **CAPTURE_ONLY, "max_probe_columns": COLUMNS}
    model = SteeredVLLM(llama_path, dtype="float32", capture_values=["layers.1.layer_output"], **settings)
    yield model
    model.shutdown()


def expected_last(llama_path, docs: list[str], probes: dict[str, Probe]) -> dict[str, torch.Tensor]:
    """Each probe's score of each non-empty document's last token: ``activation(h @ w + b)`` of the block output
    transformers' own model gives (``output_hidden_states``, the blocks before the last: not normed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    found: dict[str, list[torch.Tensor]] = {name: [] for name in probes}
    for doc in docs:
        if not doc:
            continue
        ids = [tokenizer.bos_token_id, *tokenizer(doc, add_special_tokens=False)["input_ids"]]
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        for name, probe in probes.items():
            scores = hidden[probe.layer + 1][0, -1] @ probe.weight + probe.bias
            scores = scores.sigmoid() if probe.activation == "sigmoid" else scores.softmax(-1)
            found[name].append(scores[0] if probe.classes == 1 else scores)
    return {name: torch.stack(scores) for name, scores in found.items()}


def test_probe_values_equal_h_at_w_plus_b_on_both_engines(llama_path, llama, engine, tmp_path):
    docs = documents(7)
    probes = make_probes(llama.hidden_size)
    options = {"positions": "last", "probes": probes, "progress": False}
    on_hf = harvest(llama, docs, VALUES, tmp_path / "hf", **options)
    on_vllm = harvest(engine, docs, VALUES, tmp_path / "vllm", **options)
    expected = expected_last(llama_path, docs, probes)
    assert on_vllm.manifest["vllm_path"] == "engine"
    count = sum(1 for doc in docs if doc)
    for result in (on_hf, on_vllm):
        assert result.values == VALUES and len(result) == count
        one, three = result.load("probes.one"), result.load("probes.three")
        assert one.shape == (count,) and three.shape == (count, 3) and one.dtype == three.dtype == torch.float32
        torch.testing.assert_close(one, expected["one"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(three, expected["three"], atol=1e-4, rtol=1e-4)
        entry = result.manifest["values"]["probes.three"]
        assert entry["shape"] == [3] and entry["dtype"] == "float32" and entry["module"] is None
        assert entry["probe"]["layer"] == 0 and entry["probe"]["weight_shape"] == [llama.hidden_size, 3]
        assert entry["probe"]["activation"] == "softmax"
        assert result.manifest["values"]["probes.one"]["shape"] == []
    assert on_hf.manifest["values"] == on_vllm.manifest["values"]
    for name in ("token_ids", "documents", "offsets"):
        assert torch.equal(on_vllm.load(name), on_hf.load(name)), name
    for name in VALUES:
        torch.testing.assert_close(on_vllm.load(name), on_hf.load(name), atol=1e-4, rtol=1e-4)


def test_only_probes_under_a_mask_and_in_the_sae_lens_layout(llama, engine, tmp_path):
    """A harvest of probes alone (no value the engine keeps) at masked positions, and probes beside a residual in
    the SAELens layout: the same numbers on both engines, and in both layouts."""
    import datasets

    docs = documents(9, seed=1)
    probes = make_probes(llama.hidden_size)
    names = ["probes.one", "probes.three"]

    def odd(ids: list[int]) -> list[bool]:
        return [i % 2 == 1 for i in range(len(ids))]

    masked = {"positions": odd, "probes": probes, "progress": False}
    alone_hf = harvest(llama, docs, names, tmp_path / "alone-hf", **masked)
    alone_vllm = harvest(engine, docs, names, tmp_path / "alone-vllm", **masked)
    assert torch.equal(alone_vllm.load("offsets"), alone_hf.load("offsets"))
    assert (alone_hf.load("offsets") % 2 == 1).all() and len(alone_hf) > 0
    for name in names:
        torch.testing.assert_close(alone_vllm.load(name), alone_hf.load(name), atol=1e-4, rtol=1e-4)
    packed = {"context_length": 16, "probes": probes, "progress": False}
    default = harvest(llama, docs, VALUES, tmp_path / "default", overflow="pack", **packed)
    layouts = [
        harvest(model, docs, VALUES, tmp_path / kind, format="sae-lens", **packed)
        for kind, model in (
            ("sae-lens-hf", llama),
            ("sae-lens-vllm", engine),
        )
    ]
    rows = len(layouts[0]) // 16
    assert rows > 0
    for result in layouts:
        dataset = datasets.load_from_disk(str(result.path))
        assert dataset.features["probes.one"] == datasets.Sequence(datasets.Value("float32"), length=16)
        assert dataset.features["probes.three"] == datasets.Array2D((16, 3), "float32")
        for name in VALUES:
            torch.testing.assert_close(result.load(name), default.load(name)[: rows * 16], atol=1e-4, rtol=1e-4)
        ours = dataset.with_format("torch")[:]["probes.three"].reshape(-1, 3)
        torch.testing.assert_close(ours, result.load("probes.three"))


def test_resuming_with_another_probe_is_refused(llama, tmp_path):
    docs = documents(5)
    probes = make_probes(llama.hidden_size)
    out = tmp_path / "out"
    harvest(llama, docs, ["probes.one"], out, probes={"one": probes["one"]}, progress=False)
    again = harvest(llama, docs, ["probes.one"], out, probes={"one": probes["one"]}, progress=False)
    assert again.manifest["complete"]
    other = Probe(probes["one"].weight * 2, bias=0.3, layer=1, activation="sigmoid")
    with pytest.raises(HarvestError, match=r"other settings(.|\n)*values"):
        harvest(llama, docs, ["probes.one"], out, probes={"one": other}, progress=False)


@pytest.mark.parametrize(
    "values, probes, message",
    [
        (["probes.missing"], lambda n: {}, r"'probes.missing': no probe named 'missing' in probes= \(it holds none\)"),
        (
            ["layers.0.layer_output"],
            lambda n: {"one": Probe(torch.ones(n))},
            r"probes \['one'\] are given but no value reads them: add \['probes.one'\] to values",
        ),
        (["probes.narrow"], lambda n: {"narrow": Probe(torch.ones(7))}, "weight is 7 wide; this model's stream is 128"),
        (
            ["probes.late"],
            lambda n: {"late": Probe(torch.ones(n), positions="last")},
            "the harvest's positions= choose the tokens of every value; build the probe with positions='all'",
        ),
    ],
)
def test_bad_probes_are_refused_before_any_work(llama, tmp_path, values, probes, message):
    calls = []
    handle = llama._module.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            harvest(llama, documents(3), values, tmp_path / "out", probes=probes(llama.hidden_size), progress=False)
    finally:
        handle.remove()
    assert not calls and not (tmp_path / "out").exists()


def test_an_engine_without_enough_probe_columns_is_refused_before_any_work(engine, tmp_path):
    wide = {"wide": Probe(torch.ones(engine.hidden_size, COLUMNS + 1))}
    requests = engine.request_counter.counter
    message = rf"read {COLUMNS + 1} probe columns .* at most {COLUMNS}: build it with max_probe_columns={COLUMNS + 1}"
    with pytest.raises(ValueError, match=message):
        harvest(engine, documents(3), ["probes.wide"], tmp_path / "out", probes=wide, progress=False)
    assert engine.request_counter.counter == requests and not (tmp_path / "out").exists()


def test_the_engine_a_harvest_builds_reads_its_probes():
    """A vLLM harvest of a checkpoint builds its engine with a probe column per class, keeping only the other
    values (none where it reads only probes)."""
    from nnterp_vllm.harvest.compute import build_settings
    from nnterp_vllm.harvest.in_engine import CAPTURE_VALUES
    from nnterp_vllm.specs.selection import check_selectors

    probes = make_probes(tiny.config_kwargs("llama")["hidden_size"])
    both = build_settings(check_selectors(VALUES, None, probes), "vllm", None)
    assert both["max_probe_columns"] == 4 and both[CAPTURE_VALUES] == ["layers.1.layer_output"]
    alone = build_settings(check_selectors(["probes.three"], None, {"three": probes["three"]}), "vllm", None)
    assert alone["max_probe_columns"] == 3 and alone[CAPTURE_VALUES] is None


@pytest.mark.slow
def test_a_vllm_harvest_of_a_checkpoint_reads_its_probes_in_the_engine(llama_path, llama, tmp_path):
    """The engine a harvest of a checkpoint builds reads the probes itself: the transformers harvest's scores."""
    docs = documents(6, seed=2)
    options = {"positions": "last", "probes": make_probes(llama.hidden_size), "progress": False}
    names = ["probes.one", "probes.three"]
    on_hf = harvest(llama, docs, names, tmp_path / "hf", **options)
    on_vllm = harvest(
        llama_path, docs, names, tmp_path / "vllm", engine="vllm", model_kwargs={"dtype": "float32"}, **options
    )
    assert on_vllm.manifest["vllm_path"] == "engine" and on_vllm.manifest["blocks_run"] == 2
    for name in names:
        torch.testing.assert_close(on_vllm.load(name), on_hf.load(name), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_a_vllm_harvest_through_nnsight_scores_probes_from_the_block_output(llama_path, llama, tmp_path):
    """A StandardizedVLLM passed in reads the block's output through nnsight and scores it as transformers does."""
    from nnterp_vllm import StandardizedVLLM

    docs = documents(5, seed=3)
    options = {"positions": "last", "probes": make_probes(llama.hidden_size), "progress": False}
    on_hf = harvest(llama, docs, VALUES, tmp_path / "hf", **options)
    model = StandardizedVLLM(llama_path, dtype="float32", dispatch=True)
    try:
        on_vllm = harvest(model, docs, VALUES, tmp_path / "vllm", **options)
    finally:
        model.shutdown()
    assert on_vllm.manifest["vllm_path"] == "nnsight"
    for name in VALUES:
        torch.testing.assert_close(on_vllm.load(name), on_hf.load(name), atol=1e-4, rtol=1e-4)


def test_cli_harvests_a_probe_from_a_file(llama_path, llama, tmp_path, capsys):
    import json

    import safetensors.torch

    from nnterp_vllm.cli import main

    probe = make_probes(llama.hidden_size)["three"]
    path = tmp_path / "three.safetensors"
    safetensors.torch.save_file({"weight": probe.weight, "bias": probe.bias}, path)
    docs = documents(5)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    arguments = ["harvest", str(llama_path), "--corpus", str(corpus), "--values", "probes.three", "--quiet"]
    assert main([*arguments, "--probe", f"three={path}@0:softmax", "--out", str(tmp_path / "cli")]) == 0
    direct = harvest(llama_path, docs, ["probes.three"], tmp_path / "direct", probes={"three": probe}, progress=False)
    written = load_harvest(tmp_path / "cli")
    assert written.manifest["values"] == direct.manifest["values"]
    torch.testing.assert_close(written.load("probes.three"), direct.load("probes.three"))
    planned = ["--probe", f"three={path}@0:softmax", "--out", str(tmp_path / "plan"), "--plan"]
    capsys.readouterr()
    assert main([*arguments, *planned]) == 0
    assert "bytes per token: 44 (12 of values, 32 of token metadata)" in capsys.readouterr().out  # 3 float32 scores
    with pytest.raises(ValueError, match=r"--probe takes NAME=PATH.safetensors@LAYER"):
        probes_given([f"three={path}"])
