"""Vectors made elsewhere, as `Steering`: each format read back exactly, applied as its own library applies it.

repeng's and steering-vectors' own code steers SmolLM2 on transformers; our import of the same vector, applied by
`StandardizedTransformer.steer` and by `SteeredVLLM`, gives the same greedy tokens. The libraries are installed
beside the environment (`make install`, ``.cache/steering-libs``): their pins (numpy < 2, transformers < 5) do not
hold here, and their code runs as shipped (repeng 0.4 names ``numpy.float_``, gone from numpy 2: restored as the
alias it was before importing it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy
import pytest
import tiny
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from nnterp_vllm import StandardizedTransformer, Steering, contrast_steering, load_steering
from nnterp_vllm.checkpoints import smollm2
from nnterp_vllm.specs.saes import sae_layer

LIBRARIES = Path(__file__).resolve().parent.parent / ".cache" / "steering-libs"
PROMPT = "The best way to spend a Sunday is"
STEPS = 8


@pytest.fixture(scope="module")
def libraries():
    """repeng and steering-vectors, as shipped."""
    if not LIBRARIES.is_dir():
        pytest.fail(f"{LIBRARIES} is missing: run `make install`")
    sys.path.insert(0, str(LIBRARIES))
    numpy.float_ = numpy.float64  # repeng 0.4 annotates with the numpy 1 name
    import repeng
    import steering_vectors

    yield repeng, steering_vectors
    sys.path.remove(str(LIBRARIES))


def directions(hidden: int, layers: list[int], seed: int = 0) -> dict[int, numpy.ndarray]:
    generator = torch.Generator().manual_seed(seed)
    return {layer: (torch.randn(hidden, generator=generator) * 0.5).numpy() for layer in layers}


def specs_as_tuples(specs: list[Steering]) -> list[tuple]:
    return [(spec.layers, spec.vector.tolist(), spec.factor, spec.positions) for spec in specs]


# ------------------------------------------------------------------------------------------ reading formats


def test_repeng_control_vectors_round_trip_as_objects_and_gguf_files(libraries, tmp_path):
    repeng, _ = libraries
    vector = repeng.ControlVector(model_type="llama", directions=directions(16, [-1, -3, 4]))
    path = tmp_path / "vector.gguf"
    vector.export_gguf(str(path))
    from_object = load_steering(vector, factor=-2.0)
    from_file = load_steering(path, factor=-2.0)
    assert specs_as_tuples(from_object) == specs_as_tuples(from_file)
    assert [spec.layers for spec in from_file] == [[-3], [-1], [4]]  # repeng's own numbering, from the end
    for spec in from_file:
        torch.testing.assert_close(spec.vector, torch.from_numpy(vector.directions[spec.layers[0]]))
        assert spec.factor == -2.0 and spec.positions == "all"
    assert [spec.layers for spec in load_steering(path, layers=[4, -1])] == [[-1], [4]]


def test_steering_vectors_round_trip_as_objects_and_saved_dicts(libraries, tmp_path):
    _, steering_vectors = libraries
    vector = steering_vectors.SteeringVector(
        layer_activations={k: torch.from_numpy(v) for k, v in directions(16, [2, 5]).items()}
    )
    torch.save(vars(vector), tmp_path / "vector.pt")
    save_file(
        {f"layer_activations.{k}": v for k, v in vector.layer_activations.items()},
        tmp_path / "vector.safetensors",
        metadata={"layer_type": vector.layer_type},
    )
    loaded = [
        load_steering(source, factor=3.0)
        for source in (vector, tmp_path / "vector.pt", tmp_path / "vector.safetensors")
    ]
    assert specs_as_tuples(loaded[0]) == specs_as_tuples(loaded[1]) == specs_as_tuples(loaded[2])
    assert [(spec.layers, spec.factor) for spec in loaded[0]] == [([2], 3.0), ([5], 3.0)]


def test_a_saelens_feature_is_its_decoder_row_at_the_block_the_sae_reads(tmp_path):
    from sae_lens import StandardSAE, StandardSAEConfig
    from sae_lens.saes.sae import SAEMetadata

    torch.manual_seed(0)
    for hook, layer in (("blocks.6.hook_resid_post", 6), ("blocks.6.hook_resid_pre", 5), ("model.layers.6", 6)):
        sae = StandardSAE(StandardSAEConfig(d_in=16, d_sae=8, metadata=SAEMetadata(hook_name=hook)))
        with torch.no_grad():
            sae.W_dec.normal_()
        sae.save_model(str(tmp_path / hook))
        (spec,) = load_steering(tmp_path / hook, feature=3, factor=8.0, positions="generated")
        assert (spec.layers, spec.factor, spec.positions) == ([layer], 8.0, "generated")
        torch.testing.assert_close(spec.vector, sae.W_dec[3].detach())
    assert sae_layer("blocks.0.hook_resid_pre") is None  # the embeddings: no block's output


def write(path: Path, content: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


class NotAVector:
    """Pickled, it is code, not tensors: torch.load(weights_only=True) refuses it."""


def malformed(tmp_path: Path, libraries) -> list[tuple]:
    """(source, feature, what the message names) for a malformed file of every kind."""
    import gguf

    repeng, _ = libraries
    wrong_arch = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(str(wrong_arch), "llama")
    writer.add_tensor("direction.1", numpy.zeros(4, dtype=numpy.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()
    wrong_tensor = tmp_path / "tensor.gguf"
    writer = gguf.GGUFWriter(str(wrong_tensor), "controlvector")
    writer.add_tensor("weights.1", numpy.zeros(4, dtype=numpy.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()
    torch.save({"activations": {1: torch.zeros(4)}}, tmp_path / "keys.pt")
    torch.save({"layer_activations": {1: torch.zeros(4)}, "layer_type": "mlp"}, tmp_path / "mlp.pt")
    torch.save({"layer_activations": {1: NotAVector()}}, tmp_path / "code.pt")
    save_file({"vector": torch.zeros(4)}, tmp_path / "names.safetensors")
    sae = tmp_path / "sae"
    sae.mkdir()
    save_file({"W_dec": torch.zeros(8, 4)}, sae / "sae_weights.safetensors")
    write(sae / "cfg.json", json.dumps({"metadata": {"hook_name": "blocks.2.hook_mlp_out"}}))
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    return [
        (wrong_arch, None, "general.architecture is 'llama'"),
        (wrong_tensor, None, "tensor 'weights.1' is not named direction.<layer>"),
        (tmp_path / "keys.pt", None, "keys.pt: .*has 'layer_activations'.*found \\['activations'\\]"),
        (tmp_path / "mlp.pt", None, "mlp.pt: layer_type is 'mlp'"),
        (tmp_path / "code.pt", None, "code.pt is none of the formats"),
        (tmp_path / "names.safetensors", None, "tensor 'vector' is not named layer_activations.<layer>"),
        (write(tmp_path / "text.txt", "not a vector"), None, "text.txt is none of the formats"),
        (sae, 3, "hook_name 'blocks.2.hook_mlp_out' is not a block's residual stream"),
        (no_config, 3, "no-config is no SAELens SAE directory: it has no cfg.json"),
        (tmp_path / "missing.gguf", None, "missing.gguf does not exist"),
    ]


def test_a_malformed_source_is_refused_naming_the_file_and_the_field(libraries, tmp_path):
    for source, feature, message in malformed(tmp_path, libraries):
        with pytest.raises(ValueError, match=message):
            load_steering(source, feature=feature)
    sae = tmp_path / "sae"
    write(sae / "cfg.json", json.dumps({"metadata": {"hook_name": "blocks.2.hook_resid_post"}}))
    with pytest.raises(ValueError, match="feature must be an int in 0..7"):
        load_steering(sae, feature=8)
    with pytest.raises(ValueError, match="carries layers \\[2\\], not \\[5\\]"):
        load_steering(sae, feature=1, layers=[5])
    with pytest.raises(TypeError, match="not dict"):
        load_steering({1: torch.zeros(4)})


# ---------------------------------------------------------------------------------------- applied as shipped


def greedy(model, inputs) -> list[int]:
    """A plain transformers model's greedy tokens after ``inputs``."""
    output = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    return output[0, inputs["input_ids"].shape[1] :].tolist()


def steered_by_us(model: StandardizedTransformer, specs: list[Steering]) -> list[int]:
    """Greedy tokens with each spec added by ``steer`` at every step (the prompt, then each generated token)."""
    with model.generate(PROMPT, max_new_tokens=STEPS, do_sample=False) as tracer:
        for _ in tracer.iter[:STEPS]:
            for spec in specs:
                model.steer(spec.layers, spec.vector, spec.factor)
        tokens = model.generator.output.save()
    return tokens[0, -STEPS:].tolist()


@pytest.fixture(scope="module")
def smol():
    """SmolLM2 twice: a plain transformers model for the libraries to patch, and ours."""
    plain = AutoModelForCausalLM.from_pretrained(smollm2(), dtype=torch.float32).eval()
    ours = StandardizedTransformer(smollm2())
    inputs = dict(ours.tokenizer(PROMPT, return_tensors="pt"))
    return plain, ours, inputs, greedy(plain, inputs)


@pytest.fixture(scope="module")
def by_libraries(libraries, smol, tmp_path_factory):
    """Per library: a vector applied by its own code to the plain model, its greedy tokens, and our import of
    the vector saved as that library saves it."""
    repeng, steering_vectors = libraries
    plain, _, inputs, unsteered = smol
    hidden, saved = plain.config.hidden_size, tmp_path_factory.mktemp("vectors")
    control = repeng.ControlVector(model_type="llama", directions=directions(hidden, [10, 11], seed=1))
    controlled = repeng.ControlModel(plain, [10, 11])
    controlled.set_control(control, coeff=4.0)
    try:
        by_repeng = greedy(plain, inputs)
    finally:
        controlled.unwrap()
    vector = steering_vectors.SteeringVector(
        {k: torch.from_numpy(v) for k, v in directions(hidden, [8, 12], 2).items()}
    )
    with vector.apply(plain, multiplier=-3.0):
        by_steering_vectors = greedy(plain, inputs)
    control.export_gguf(str(saved / "control.gguf"))
    torch.save(vars(vector), saved / "vector.pt")
    return {
        "repeng": (load_steering(saved / "control.gguf", factor=4.0), by_repeng),
        "steering-vectors": (load_steering(saved / "vector.pt", factor=-3.0), by_steering_vectors),
    }


def test_repeng_and_steering_vectors_steer_as_our_import_does_on_transformers(smol, by_libraries):
    _, ours, _, unsteered = smol
    for name, (specs, expected) in by_libraries.items():
        assert expected != unsteered, f"{name}'s vector changed nothing"
        assert steered_by_us(ours, specs) == expected, name


@pytest.mark.slow
def test_steered_vllm_gives_the_libraries_tokens(smol, by_libraries):
    """The same imports in `SteeredVLLM` (the README's engine settings: one compiled model for both)."""
    from vllm import SamplingParams

    from nnterp_vllm import SteeredVLLM

    unsteered = smol[3]
    cases = list(by_libraries.values())
    llm = SteeredVLLM(smollm2(), dtype="float32", max_model_len=512, capture_values=["layers.*.layer_output"])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=STEPS)
        outputs = llm.generate([PROMPT] * (len(cases) + 1), params, [specs for specs, _ in cases] + [None])
    finally:
        llm.shutdown()
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    assert tokens == [expected for _, expected in cases] + [unsteered]


def test_contrast_vectors_are_the_mean_difference_and_the_first_component_of_paired_differences():
    from sklearn.decomposition import PCA

    path = tiny.checkpoint("llama")
    model = StandardizedTransformer(path)
    positive = ["I love this, it is wonderful", "What a great day", "Fantastic work, thank you", "so happy now"]
    negative = ["I hate this, it is awful", "What a terrible day", "Dreadful work, no thanks", "so sad now"]
    mean, pca = (contrast_steering(model, positive, negative, [0, 1], method=method) for method in ("mean", "pca"))
    plain = AutoModelForCausalLM.from_pretrained(path).eval()

    def last_streams(texts: list[str]) -> torch.Tensor:  # [texts, layers + 1, hidden], BOS first as the harvest reads
        bos = model.tokenizer.bos_token_id
        rows = [[bos, *model.tokenizer(text, add_special_tokens=False)["input_ids"]] for text in texts]
        with torch.no_grad():
            states = [plain(torch.tensor([row]), output_hidden_states=True).hidden_states for row in rows]
        return torch.stack([torch.stack(state)[:, 0, -1] for state in states])

    ups, downs = last_streams(positive), last_streams(negative)
    for index, layer in enumerate([0, 1]):
        assert mean[index].layers == pca[index].layers == [layer]
        torch.testing.assert_close(
            mean[index].vector, ups[:, layer + 1].mean(0) - downs[:, layer + 1].mean(0), atol=1e-5, rtol=1e-5
        )
        component = torch.from_numpy(PCA(n_components=1).fit((ups - downs)[:, layer + 1].numpy()).components_[0])
        up, down = ups[:, layer + 1] @ component.float(), downs[:, layer + 1] @ component.float()
        above, below = int((up > down).sum()), int((up < down).sum())  # repeng's rule; a tie by the mean
        sign = (1 if above > below else -1) if above != below else (1 if (up - down).mean() >= 0 else -1)
        torch.testing.assert_close(pca[index].vector, sign * component.float(), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="pairs the texts: 4 positive, 1 negative"):
        contrast_steering(model, positive, negative[:1], 0, method="pca")
    with pytest.raises(ValueError, match="method must be 'mean' or 'pca'"):
        contrast_steering(model, positive, negative, 0, method="median")
