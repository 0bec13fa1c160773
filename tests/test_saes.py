"""Sparse autoencoders: SAELens's SAEs read from their directories compute SAELens's own features; what is no SAE
served here is refused naming why."""

from __future__ import annotations

import json

import pytest
import reference
import torch

from nnterp_vllm import SAE
from nnterp_vllm.specs.saes import sae_list

HIDDEN = 16


@pytest.mark.parametrize(
    ("architecture", "cfg"),
    [
        ("standard", {}),
        ("standard", {"apply_b_dec_to_input": False}),
        ("jumprelu", {}),
        ("topk", {"k": 5}),
        ("topk", {"k": 3, "rescale_acts_by_decoder_norm": True}),
    ],
)
def test_features_and_reconstruction_are_saelens_own(tmp_path, architecture, cfg):
    theirs = reference.saelens_sae(tmp_path / "sae", architecture, "blocks.2.hook_resid_post", HIDDEN, **cfg)
    ours = SAE.load(tmp_path / "sae")
    assert (ours.layer, ours.architecture, ours.d_sae, ours.d_in, ours.name) == (2, architecture, 64, HIDDEN, "sae")
    stream = torch.randn(3, 7, HIDDEN, generator=torch.Generator().manual_seed(1)) * 2
    with torch.no_grad():
        expected = theirs.encode(stream)
        features = ours.encode(stream)
        torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)
        active = (features > 0).float().mean()
        assert 0.02 < active < 0.6, f"the seeded SAE should have some features active and most not, got {active}"
        torch.testing.assert_close(ours.decode(features), theirs.decode(expected), rtol=1e-5, atol=1e-5)


def test_the_block_an_sae_reads_follows_its_hook(tmp_path):
    for hook, layer in (("blocks.3.hook_resid_pre", 2), ("model.layers.4", 4), ("blocks.0.hook_resid_post", 0)):
        reference.saelens_sae(tmp_path / hook, "standard", hook, HIDDEN)
        assert SAE.load(tmp_path / hook).layer == layer


def saved(tmp_path, **changes):
    """A saved SAE directory whose cfg.json has ``changes`` applied (``None`` removes a key)."""
    reference.saelens_sae(tmp_path / "sae", "topk", "blocks.1.hook_resid_post", HIDDEN, k=4)
    config = json.loads((tmp_path / "sae" / "cfg.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (tmp_path / "sae" / "cfg.json").write_text(json.dumps(config))
    return tmp_path / "sae"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architecture": "gated"}, "architecture 'gated' is not served; served: standard, jumprelu, topk"),
        ({"normalize_activations": "layer_norm"}, "normalize_activations is 'layer_norm'; only SAEs with"),
        ({"reshape_activations": "hook_z"}, "reshape_activations is 'hook_z'"),
        ({"k": 0}, "a TopK SAE's k must be an int in 1..64, got 0"),
        ({"metadata": {"hook_name": "blocks.1.hook_mlp_out"}}, "is not a block's residual stream"),
    ],
)
def test_what_is_no_served_sae_is_refused_naming_why(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SAE.load(saved(tmp_path, **changes))


def test_a_damaged_directory_is_refused_naming_the_file(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(ValueError, match="is not a directory"):
        SAE.load(tmp_path / "nowhere")
    directory = saved(tmp_path)
    save_file({"W_enc": torch.zeros(HIDDEN, 64)}, directory / "sae_weights.safetensors")
    with pytest.raises(ValueError, match="sae_weights.safetensors has no b_enc, W_dec, b_dec tensor"):
        SAE.load(directory)
    save_file(
        {
            "W_enc": torch.zeros(HIDDEN, 64),
            "b_enc": torch.zeros(64),
            "W_dec": torch.zeros(64, 8),
            "b_dec": torch.zeros(8),
        },
        directory / "sae_weights.safetensors",
    )
    with pytest.raises(
        ValueError, match=r"W_dec has shape \[64, 8\]; W_enc \[d_in, d_sae\] sets the others: W_dec \[64, 16\]"
    ):
        SAE.load(directory)
    (directory / "sae_weights.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        SAE.load(directory)
    with pytest.raises(TypeError, match="must be a SAELens SAE directory, not int"):
        SAE.load(3)


def test_a_model_holds_one_sae_per_block_that_fits_it(tmp_path):
    for name, hook in (
        ("a", "blocks.1.hook_resid_post"),
        ("b", "blocks.2.hook_resid_pre"),
        ("c", "blocks.5.hook_resid_post"),
    ):
        reference.saelens_sae(tmp_path / name, "standard", hook, HIDDEN)
    with pytest.raises(ValueError, match="share the layer 1; a model holds one SAE per block"):
        sae_list([tmp_path / "a", tmp_path / "b"])
    with pytest.raises(ValueError, match="share the name 'a'"):
        sae_list([SAE.load(tmp_path / "a"), SAE.load(tmp_path / "c", name="a")])
    with pytest.raises(
        ValueError, match=r"reads the output of block 5 \(hook blocks.5.hook_resid_post\); the model has 4"
    ):
        sae_list([tmp_path / "c"], num_layers=4, hidden_size=HIDDEN)
    with pytest.raises(ValueError, match="reads a stream of width 16; this model's residual stream is 32 wide"):
        sae_list([tmp_path / "a"], num_layers=4, hidden_size=32)
    with pytest.raises(TypeError, match="an SAE is a loaded nnterp_vllm.SAE or a SAELens SAE directory, not int"):
        sae_list([3])
    assert [sae.layer for sae in sae_list([tmp_path / "a", tmp_path / "c"], 6, HIDDEN)] == [1, 5]


def test_a_clamp_is_checked_as_it_is_made_and_against_the_model(tmp_path):
    from nnterp_vllm import Clamp

    reference.saelens_sae(tmp_path / "jump", "jumprelu", "blocks.3.hook_resid_pre", HIDDEN)
    sae = SAE.load(tmp_path / "jump")
    clamp = Clamp(tmp_path / "jump", 7, value=2.5, positions=[0, -1])
    assert (clamp.sae.layer, clamp.layers, clamp.bounds, clamp.scale) == (2, [2], (2.5, 2.5), None)
    engine = clamp.resolved(num_layers=4, hidden_size=HIDDEN, prompt_length=5)
    read, offset, threshold = sae.feature_encoder(7)
    assert engine["kind"] == "clamp" and engine["positions"] == [0, 4] and engine["topk"] is None
    assert engine["threshold"] == threshold == max(0.0, float(sae.threshold[7]))
    torch.testing.assert_close(torch.tensor(engine["vector"]), read)
    torch.testing.assert_close(torch.tensor(engine["write"]), sae.W_dec[7])
    stream = torch.randn(9, HIDDEN)
    pre = stream @ read + offset
    torch.testing.assert_close(pre, sae.pre_activation(stream)[:, 7], rtol=1e-5, atol=1e-5)
    for kwargs, message in [
        ({"feature": 64, "value": 1.0}, r"feature must be an int in 0..63 \(the SAE's d_sae\), got 64"),
        ({"feature": True, "value": 1.0}, "feature must be an int"),
        ({"feature": 1}, "give value= .* or scale=, exactly one"),
        ({"feature": 1, "value": 1.0, "scale": 2.0}, "exactly one"),
        ({"feature": 1, "value": float("nan")}, "value must be a finite number"),
        ({"feature": 1, "scale": 2.0, "positions": "decode"}, "positions must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            Clamp(sae, **kwargs)
    with pytest.raises(TypeError, match="an SAE is a loaded nnterp_vllm.SAE or a SAELens SAE directory, not list"):
        Clamp([1.0], 1, value=1.0)
    with pytest.raises(ValueError, match="reads block 2's output, 16 wide; this model has 2 blocks, 16 wide"):
        clamp.resolved(num_layers=2, hidden_size=HIDDEN, prompt_length=5)


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_a_harvest_of_sae_features_holds_saelens_encoding_and_names_the_sae(tmp_path, engine):
    """``layers.1.sae_features`` harvested from a checkpoint built with ``saes=[...]`` (``model_kwargs``): each
    document's rows are SAELens's ``encode`` of transformers' stream leaving block 1, and the manifest names the
    SAE (on vLLM the nnsight path reads them)."""
    import tiny

    from nnterp_vllm import harvest

    path = tiny.checkpoint("llama")
    theirs = reference.saelens_sae(tmp_path / "sae", "jumprelu", "blocks.1.hook_resid_post", 128, stream_scale=0.07)
    documents = ["The quick brown fox jumps", "A cup of coffee in the morning"]
    options = {"dtype": "float32", "max_model_len": 128} if engine == "vllm" else {}
    kept = harvest(
        path,
        documents,
        ["layers.1.sae_features", "layers.1.layer_output"],
        tmp_path / "out",
        engine=engine,
        model_kwargs={"saes": [tmp_path / "sae"], **options},
        progress=False,
    )
    entry = kept.manifest["values"]["layers.1.sae_features"]
    assert entry["shape"] == [64] and entry["sae"]["digest"] == SAE.load(tmp_path / "sae").digest
    assert entry["sae"]["hook"] == "blocks.1.hook_resid_post"
    features = kept.load("layers.1.sae_features")
    model = reference.load(path)
    token_ids, owners = kept.load("token_ids"), kept.load("documents")
    expected = []
    for document in range(len(documents)):
        stream = reference.block_outputs(model, token_ids[owners == document].tolist(), [1])[1]
        with torch.no_grad():
            expected.append(theirs.encode(stream))
    expected = torch.cat(expected)
    assert features.shape == expected.shape and (expected > 0).any()
    torch.testing.assert_close(features.float(), expected, atol=1e-4, rtol=1e-4)
