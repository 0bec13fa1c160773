"""SAE features as a standardized value, on both engines: ``model.layers[i].sae_features`` on a model built with
``saes=[...]``, written like any value, and ``model.clamp``; against SAELens's own SAEs (saved by SAELens, its
``encode`` and ``decode``) and plain transformers with forward hooks.

Each test is one function run on both engines, as the README teaches: `StandardizedTransformer` and
`StandardizedVLLM` (one vLLM engine for the module, shut down at its end) over the same tiny llama.
"""

from __future__ import annotations

import pickle
import shutil

import pytest
import reference
import tiny
import torch

from nnterp_vllm import SAE, StandardizedTransformer, StandardizedVLLM, UnavailableValue
from nnterp_vllm import standardized as root
from nnterp_vllm.components.sae import NO_SAE

#: Both engines in fp32: values agree with transformers' to rounding (vLLM's fused kernels round otherwise).
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}
#: SAELens's three architectures at three blocks, by the hook each reads, and their configs. Block 3 (the last)
#: holds none: transformers' last hidden state is after the final norm, and a block without an SAE is tested too.
SAES = {
    "standard": ("blocks.0.hook_resid_post", {}),
    "jumprelu": ("blocks.2.hook_resid_pre", {}),
    "topk": ("blocks.2.hook_resid_post", {"k": 8, "rescale_acts_by_decoder_norm": True}),
}
LAYER = {"standard": 0, "jumprelu": 1, "topk": 2}
#: The block no SAE reads.
BARE = 3


@pytest.fixture(scope="module")
def path():
    """A tiny llama of four blocks."""
    return tiny.checkpoint("llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def hf(path):
    """Transformers' own model, and its hidden states on the prompt."""
    model = reference.load(path)
    return model, reference.run(model, output_hidden_states=True).hidden_states


@pytest.fixture(scope="module")
def saelens(hf, tmp_path_factory):
    """SAELens SAEs saved by SAELens into their directories, each with weights sized to its block's stream (about a
    tenth of its features active on the prompt): ``{kind: (directory, SAELens SAE)}``."""
    _, hidden = hf
    directory = tmp_path_factory.mktemp("saes")
    built = {}
    for kind, (hook, cfg) in SAES.items():
        scale = hidden[LAYER[kind] + 1].std().item()
        sae = reference.saelens_sae(directory / kind, kind, hook, 128, seed=3, stream_scale=scale, **cfg)
        built[kind] = (directory / kind, sae)
    return built


@pytest.fixture(scope="module")
def on_transformers(path, saelens):
    """The transformers engine, holding the SAEs loaded."""
    return StandardizedTransformer(path, saes=[SAE.load(directory) for directory, _ in saelens.values()])


@pytest.fixture(scope="module")
def on_vllm(path, saelens):
    """The vLLM engine, holding the SAEs by their directories; shut down when the module ends."""
    model = StandardizedVLLM(
        path, saes=[directory for directory, _ in saelens.values()], dtype="float32", dispatch=True, max_model_len=256
    )
    yield model
    model.shutdown()


@pytest.fixture(params=["transformers", "vllm"])
def model(request):
    return request.getfixturevalue(f"on_{request.param}")


def saelens_stream(hf, kind: str) -> torch.Tensor:
    """Transformers' stream leaving the block ``kind``'s SAE reads."""
    return hf[1][LAYER[kind] + 1]


def active_feature(hf, saelens, kind: str, positions: list[int] | None = None) -> int:
    """The feature of ``kind``'s SAE most active on the prompt, or at ``positions`` of it (by SAELens's own
    encode)."""
    stream = saelens_stream(hf, kind)
    if positions is not None:
        stream = stream[:, positions]
    return int(saelens[kind][1].encode(stream).sum((0, 1)).argmax())


def decoder_row(sae, feature: int) -> torch.Tensor:
    """What one unit of ``feature`` adds to SAELens's reconstruction (its ``decode``, less that of no feature)."""
    unit = torch.zeros(1, sae.cfg.d_sae)
    unit[0, feature] = 1.0
    return (sae.decode(unit) - sae.decode(torch.zeros_like(unit)))[0]


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.detach().float(), expected.detach().float(), **TOLERANCE)


def test_sae_features_equal_saelens_encode_of_transformers_stream(model, hf, saelens):
    with model.trace(reference.PROMPT):
        standard = model.layers[0].sae_features.save()
        jumprelu = model.layers[1].sae_features.save()
        topk = model.layers[2].sae_features.save()
    for kind, features in (("standard", standard), ("jumprelu", jumprelu), ("topk", topk)):
        expected = saelens[kind][1].encode(saelens_stream(hf, kind))
        assert features.shape == expected.shape == (1, expected.shape[1], 64) and features.dtype == torch.float32
        assert 0.02 < (expected > 0).float().mean() < 0.3, "the SAE should have some features active, not all"
        close(features, expected)
    assert model.support()["sae_features"] == {BARE: NO_SAE}
    assert {name: sae.layer for name, sae in model.saes.items()} == LAYER and model.saes.at(BARE) is None


@pytest.mark.parametrize("how", ["assigned", "edited in place"])
def test_writing_sae_features_equals_a_hook_adding_the_change_through_the_decoder(model, hf, saelens, how):
    kind = "jumprelu"
    layer, (_, sae) = LAYER[kind], saelens[kind]
    active = active_feature(hf, saelens, kind)
    other = (active + 1) % sae.cfg.d_sae
    with model.trace(reference.PROMPT):
        block = model.layers[layer]
        if how == "assigned":
            new = block.sae_features.clone()
            new[..., active] = 0.0
            new[..., other] = 3.0
            block.sae_features = new
        else:
            block.sae_features[..., active] = 0.0
            block.sae_features[..., other] = 3.0
        logits = model.logits.save()

    def hook(_, h):
        old = sae.encode(h)
        new = old.clone()
        new[..., active] = 0.0
        new[..., other] = 3.0
        return h + (new - old) @ sae.W_dec

    close(logits, reference.with_block_output(hf[0], layer, hook))


@pytest.mark.parametrize(
    ("kind", "setting", "positions"),
    [
        ("standard", {"value": 6.0}, None),
        ("jumprelu", {"scale": 0.0}, [0, -1]),
        ("topk", {"scale": 3.0}, None),
        ("topk", {"value": 2.5}, [2]),
    ],
)
def test_clamp_equals_a_hook_with_saelens_encode(model, hf, saelens, kind, setting, positions):
    directory, sae = saelens[kind]
    feature = active_feature(hf, saelens, kind, positions)
    with model.trace(reference.PROMPT):
        # By the name the model holds it under, or by its directory.
        model.clamp(kind if positions is None else directory, feature, positions=positions, **setting)
        logits = model.logits.save()
    row = decoder_row(sae, feature)

    def hook(_, h):
        at = list(range(h.shape[1])) if positions is None else [p % h.shape[1] for p in positions]
        h = h.clone()
        active = sae.encode(h[:, at])[..., feature]
        target = torch.full_like(active, setting["value"]) if "value" in setting else active * setting["scale"]
        h[:, at] = h[:, at] + (target - active)[..., None] * row
        return h

    expected = reference.with_block_output(hf[0], LAYER[kind], hook)
    close(logits, expected)
    with torch.no_grad():
        unclamped = reference.run(hf[0]).logits
    assert not torch.allclose(expected, unclamped, **TOLERANCE), "the clamp should change the logits"


def test_a_block_no_sae_reads_serves_no_features(model):
    with pytest.raises(UnavailableValue, match=r"sae_features is not available .* build the model with saes=\[...\]"):
        with model.trace(reference.PROMPT):
            model.layers[BARE].sae_features.save()
    with model.trace(reference.PROMPT):  # the model still traces after the refusal
        features = model.layers[0].sae_features.save()
    assert features.shape[-1] == 64


def test_clamp_refuses_what_it_cannot_do(model, saelens):
    with pytest.raises(ValueError, match=r"clamp is only served inside a trace"):
        model.clamp("standard", 1, value=1.0)
    with pytest.raises(ValueError, match=r"'nope' is neither an SAE this model holds .* it holds 'standard'"):
        with model.trace(reference.PROMPT):
            model.clamp("nope", 1, value=1.0)
    with pytest.raises(ValueError, match=r"feature must be an int in 0..63"):
        with model.trace(reference.PROMPT):
            model.clamp("topk", 64, value=1.0)
    with pytest.raises(ValueError, match=r"give value= .* or scale=, exactly one"):
        with model.trace(reference.PROMPT):
            model.clamp("topk", 1, value=1.0, scale=2.0)
    with model.trace(reference.PROMPT):  # the model still traces after the refusals
        model.clamp("topk", 1, value=1.0)
        logits = model.logits.save()
    assert logits.shape[-1] == 512


@pytest.mark.parametrize("engine", [StandardizedTransformer, StandardizedVLLM], ids=["transformers", "vllm"])
def test_saes_that_do_not_fit_the_model_are_refused_before_it_loads(engine, path, saelens, tmp_path):
    narrow = tmp_path / "narrow"
    reference.saelens_sae(narrow, "standard", "blocks.1.hook_resid_post", 64)
    with pytest.raises(ValueError, match=r"reads a stream of width 64; this model's residual stream is 128 wide"):
        engine(path, saes=[narrow], dtype="float32")
    deep = tmp_path / "deep"
    reference.saelens_sae(deep, "standard", "blocks.4.hook_resid_post", 128)
    with pytest.raises(ValueError, match=r"reads the output of block 4 .* the model has 4 blocks \(0..3\)"):
        engine(path, saes=[deep], dtype="float32")
    with pytest.raises(ValueError, match=r"share the layer 2; a model holds one SAE per block"):
        engine(path, saes=[saelens["topk"][0], SAE.load(saelens["topk"][0], "other")], dtype="float32")
    with pytest.raises(ValueError, match=r"is not a directory"):
        engine(path, saes=[tmp_path / "missing"], dtype="float32")


def test_held_saes_travel_by_directory_and_digest(saelens, tmp_path, monkeypatch):
    """What a worker in another process unpickles: each SAE loaded from its directory once, and refused where the
    directory no longer holds the SAE the client loaded."""
    directories = {kind: tmp_path / kind for kind in saelens}
    for kind, (directory, _) in saelens.items():
        shutil.copytree(directory, directories[kind])
    held = root.HeldSAEs([SAE.load(directory) for directory in directories.values()])
    payload = pickle.dumps(held)
    assert len(payload) < 2000, "the weights stay behind"
    monkeypatch.setattr(root, "_HELD", type(root._HELD)())
    monkeypatch.setattr(root, "_LOADED", {})
    elsewhere = pickle.loads(payload)
    assert list(elsewhere) == list(held) and elsewhere.at(2).digest == held.at(2).digest
    assert torch.equal(elsewhere["topk"].W_enc, held["topk"].W_enc) and elsewhere["topk"] is not held["topk"]
    assert pickle.loads(payload)["topk"] is elsewhere["topk"], "loaded once per process"
    monkeypatch.setattr(root, "_HELD", type(root._HELD)())
    monkeypatch.setattr(root, "_LOADED", {})
    reference.saelens_sae(directories["standard"], "standard", SAES["standard"][0], 128, seed=4)
    with pytest.raises(ValueError, match=r"changed on disk since the model was built with it"):
        pickle.loads(payload)
