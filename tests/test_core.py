"""The registry, loading, sizes, methods and every error path of StandardizedTransformer."""

from __future__ import annotations

import pickle
import subprocess
import sys
import types
from pathlib import Path

import nnsight
import pytest
import reference
import tiny
import torch

from nnterp_vllm import StandardizedTransformer, UnavailableValue, UnsupportedFamily, families
from nnterp_vllm.families import default


@pytest.fixture(scope="module")
def llama():
    return StandardizedTransformer(tiny.checkpoint("llama"))


@pytest.fixture(scope="module")
def llama_hf():
    return reference.load(tiny.checkpoint("llama"))


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual.detach().float(), expected.detach().float(), atol=atol, rtol=1e-4)


# -- the registry --------------------------------------------------------------


def package_imports() -> dict[str, set[str]]:
    """Each module of ``nnterp_vllm`` -> the package's modules it imports, at the top or inside a function (a
    name imported from a package is that package's module where it is one, else the package itself)."""
    import ast

    import nnterp_vllm

    root = Path(nnterp_vllm.__file__).parent
    paths = {".".join(path.relative_to(root.parent).with_suffix("").parts): path for path in root.rglob("*.py")}
    paths = {name.removesuffix(".__init__"): path for name, path in paths.items()}
    imports: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names} & set(paths)
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                modules = {f"{target}.{alias.name}" for alias in node.names} & set(paths)
                found |= modules | ({target} & set(paths) if len(modules) < len(node.names) else set())
        imports[name] = found - {name}
    return imports


def test_the_package_imports_point_one_way():
    """Every import between the package's modules, at the top or inside a function, points one way: no module
    reaches itself again through the modules it imports (the package root, which names the public API lazily,
    imports everything and is imported by nothing)."""
    imports = package_imports()
    assert {"nnterp_vllm.specs.steering", "nnterp_vllm.harvest.run"} <= set(imports)
    assert all("nnterp_vllm" not in found for name, found in imports.items() if name != "nnterp_vllm")

    done: set[str] = set()

    def reaches(start: str, seen: tuple[str, ...]) -> None:
        for name in sorted(imports[start] - done):
            assert name not in seen, f"import circle: {' -> '.join((*seen, name))}"
            reaches(name, (*seen, name))
        done.add(start)

    for module in sorted(imports):
        reaches(module, (module,))


def test_import_loads_no_modeling_code_and_lookup_loads_one_family():
    code = (
        "import sys, nnterp_vllm\n"
        "from nnterp_vllm import families\n"
        "heavy = [m for m in sys.modules if '.modeling_' in m or m == 'vllm' or m.startswith('vllm.')]\n"
        "assert not heavy, heavy\n"
        "assert families.lookup('gpt2').__name__ == 'nnterp_vllm.families.gpt2'\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('nnterp_vllm.families.') and 'families._' not in m)\n"
        "modeling = sorted(m for m in sys.modules if '.modeling_' in m and m.startswith('transformers.models.'))\n"
        "print(loaded, modeling)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, modeling = result.stdout.strip().split("] [")
    assert loaded == "['nnterp_vllm.families.gpt2'"
    assert "transformers.models.gpt2.modeling_gpt2" in modeling
    assert "llama" not in modeling


def test_known_lists_modules_by_model_type():
    known = families.known()
    assert "default" not in known and "llama" in known and "gpt2" in known
    assert all(not name.startswith("_") for name in known)


def test_register_and_lookup():
    family = types.ModuleType("my_family")
    families.register(family, "my-type")
    try:
        assert families.lookup("my-type") is family
        assert "my-type" in families.known()
    finally:
        del families.REGISTRY[families.TRANSFORMERS]["my-type"]
    with pytest.raises(ValueError, match="at least one model_type"):
        families.register(family)
    with pytest.raises(ValueError, match="unknown engine 'tpu'"):
        families.lookup("llama", engine="tpu")


def test_lookup_warns_and_falls_back_to_default():
    with pytest.warns(UserWarning, match="'no-such-type'.*default family"):
        assert families.lookup("no-such-type") is default


def test_lookup_reraises_errors_from_inside_a_family(monkeypatch):
    def broken(name, *args):
        raise ModuleNotFoundError("No module named 'some_dependency'", name="some_dependency")

    monkeypatch.setattr(families.importlib, "import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="some_dependency"):
        families.lookup("not-registered-type")


def test_vllm_engine_has_no_default():
    with pytest.raises(UnsupportedFamily, match="no vLLM family for model_type 'no-such-type'"):
        families.lookup("no-such-type", engine="vllm")


def test_family_argument_skips_the_lookup():
    model = StandardizedTransformer(tiny.checkpoint("llama"), family=default)
    assert model.family is default
    assert type(model.layers[0]) is default.Layer


# -- the default family ----------------------------------------------------------


def test_unknown_model_type_is_served_by_default_with_honest_gaps(monkeypatch):
    # A llama checkpoint whose family module cannot be found stands for a llama-like type without one.
    module, import_module = f"{families.__name__}.llama", families.importlib.import_module

    def without_llama_module(name, *args):
        if name == module:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return import_module(name, *args)

    monkeypatch.setattr(families.importlib, "import_module", without_llama_module)
    monkeypatch.setitem(families.REGISTRY, "transformers", {})
    path = tiny.checkpoint("llama")
    with pytest.warns(UserWarning, match="'llama'"):
        model = StandardizedTransformer(path)
    assert model.family is default
    expected = reference.run(reference.load(path), output_hidden_states=True, output_attentions=True)
    with model.trace(reference.PROMPT):
        pattern = model.layers[0].self_attn.attention_probabilities.save()
        output = model.layers[0].layer_output.save()
    close(output, expected.hidden_states[1])
    close(pattern, expected.attentions[0])
    reason = model.support()["attention_output"]
    assert "default family" in reason
    with pytest.raises(UnavailableValue, match="attention_output.*'default'.*sublayer adds"):
        with model.trace(reference.PROMPT):
            model.layers[0].attention_output.save()
    with pytest.raises(UnavailableValue, match="project_on_vocab"):
        model.project_on_vocab(torch.zeros(model.hidden_size))


def test_default_check_refuses_what_it_cannot_serve(monkeypatch):
    # Without the spellings of a final norm, a llama checkpoint shows the default family no `norm`.
    spellings = {path: name for path, name in default.RENAME.items() if name != "norm"}
    monkeypatch.setattr(default, "RENAME", spellings)
    with pytest.raises(UnsupportedFamily, match=r"'llama'.*\['norm'\].*rename="):
        StandardizedTransformer(tiny.checkpoint("llama"), family=default)


@pytest.mark.parametrize("model_type, kind", [("bert", "encoder-only"), ("bart", "encoder-decoder")])
def test_encoder_types_are_refused_with_the_reason_before_loading(model_type, kind):
    with pytest.raises(UnsupportedFamily, match=f"'{model_type}' is not served: {kind}"):
        families.lookup(model_type)
    with pytest.raises(UnsupportedFamily, match=f"'{model_type}' is not served: {kind}"):
        StandardizedTransformer(tiny.checkpoint(model_type))


# -- loading ------------------------------------------------------------------


def test_missing_checkpoint_directory_names_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        StandardizedTransformer(str(missing))


def test_wrapping_a_loaded_module(llama_hf):
    model = StandardizedTransformer(llama_hf, tokenizer=tiny.tokenizer())
    expected = reference.run(llama_hf, output_hidden_states=True)
    with model.trace(reference.PROMPT):
        output = model.layers[1].layer_output.save()
    close(output, expected.hidden_states[2])


def test_sdpa_attention_reports_the_pattern_unavailable():
    model = StandardizedTransformer(tiny.checkpoint("llama"), attn_implementation="sdpa")
    reason = model.support()["self_attn.attention_probabilities"]
    assert "sdpa" in reason and "eager" in reason
    with pytest.raises(UnavailableValue, match="attention_probabilities.*'llama'.*sdpa"):
        with model.trace(reference.PROMPT):
            model.layers[0].self_attn.attention_probabilities.save()
    with model.trace(reference.PROMPT):
        output = model.layers[0].layer_output.save()
    assert output.shape[-1] == model.hidden_size


# -- sizes and read-only values ---------------------------------------------------


def test_sizes(llama):
    assert (llama.num_layers, llama.hidden_size, llama.num_heads, llama.num_kv_heads) == (3, 128, 4, 2)
    assert (llama.head_dim, llama.intermediate_size, llama.vocab_size) == (32, 256, 512)


def test_family_size_functions():
    gpt2 = StandardizedTransformer(tiny.checkpoint("gpt2"))
    assert gpt2.intermediate_size == 256 and gpt2.num_kv_heads == gpt2.num_heads == 4


@pytest.mark.parametrize("name", ["num_layers", "hidden_size", "vocab_size", "head_dim"])
def test_sizes_are_read_only(llama, name):
    with pytest.raises(AttributeError, match=f"{name} is read-only"):
        setattr(llama, name, 3)


def test_next_token_probs_is_read_only(llama, llama_hf):
    with pytest.raises(AttributeError, match="next_token_probs is read-only"):
        llama.next_token_probs = torch.zeros(1)
    with llama.trace(reference.PROMPT):
        size = nnsight.save(llama.input_size)
        probs = llama.next_token_probs.save()
    logits = reference.run(llama_hf).logits
    close(probs, torch.softmax(logits[:, -1], dim=-1))
    assert tuple(size) == tuple(reference.encode()["input_ids"].shape)


def test_layer_index_out_of_range_names_num_layers(llama):
    with pytest.raises(IndexError, match="num_layers=3"):
        llama.layers[3]
    assert llama.layers[-1] is llama.layers[2]


def test_root_values_and_embeddings(llama, llama_hf):
    expected = reference.run(llama_hf, output_hidden_states=True)
    with llama.trace(reference.PROMPT):
        ids = llama.input_ids.save()
        mask = llama.attention_mask.save()
        embeddings = llama.token_embeddings.save()
        head = llama.lm_head_output.save()
        logits = llama.logits.save()
    assert torch.equal(ids, reference.encode()["input_ids"])
    assert torch.equal(mask, reference.encode()["attention_mask"])
    close(embeddings, expected.hidden_states[0])
    close(head, expected.logits)
    close(logits, expected.logits)


def test_writing_logits_and_token_embeddings(llama, llama_hf):
    with llama.trace(reference.PROMPT):
        llama.token_embeddings = llama.token_embeddings * 0
        first = llama.layers[0].layer_input.save()
        llama.logits = llama.logits * 2
        logits = llama.logits.save()
    assert torch.count_nonzero(first) == 0
    assert torch.isfinite(logits).all()


def test_migration_aliases_read_and_write(llama):
    with llama.trace(reference.PROMPT):
        aliased = llama.layers_output[0].save()
        direct = llama.layers[0].layer_output.save()
        pattern = llama.attention_probabilities[1].save()
        llama.layers_output[1] = llama.layers_output[1] * 0
        zeroed = llama.layers[1].layer_output.save()
    assert torch.equal(aliased, direct)
    assert pattern.shape[1] == llama.num_heads
    assert torch.count_nonzero(zeroed) == 0
    assert len(llama.layers_output) == llama.num_layers


# -- several invokes, generation, gradients ----------------------------------------


def test_several_invokes_equal_separate_traces(llama):
    prompts = [reference.PROMPT, reference.OTHER_PROMPT]
    separate = []
    for prompt in prompts:
        with llama.trace(prompt):
            separate.append(llama.layers[1].layer_output.save())
    together = []
    with llama.trace() as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                together.append(llama.layers[1].layer_output[:, -1].save())
    for alone, batched in zip(separate, together):
        close(batched, alone[:, -1])


def test_steered_generation_equals_a_hooked_generate(llama, llama_hf):
    vector = torch.randn(llama.hidden_size, generator=torch.Generator().manual_seed(2)) * 4
    with llama.generate(reference.PROMPT, max_new_tokens=4, do_sample=False) as tracer:
        for _ in tracer.iter[:4]:
            llama.steer(1, vector)
        tokens = tracer.result.save()

    def hook(module, args, output):
        return output + vector

    handle = reference.blocks(llama_hf)[1].register_forward_hook(hook)
    try:
        expected = llama_hf.generate(**reference.encode(), max_new_tokens=4, do_sample=False)
    finally:
        handle.remove()
    assert torch.equal(tokens, expected)


def projection_capped(stream: torch.Tensor, direction: torch.Tensor, low: float | None, high: float | None):
    """``stream`` with its projection on the unit ``direction`` clamped to ``[low, high]``, written out by hand."""
    projection = stream @ direction
    return stream + (projection.clamp(low, high) - projection)[..., None] * direction


def test_ablated_and_capped_generation_equals_a_hooked_generate(llama, llama_hf):
    generator = torch.Generator().manual_seed(4)
    ablated, capped = (torch.randn(llama.hidden_size, generator=generator) for _ in range(2))
    capped -= (capped @ ablated) / (ablated @ ablated) * ablated  # orthogonal: capping keeps the ablation
    with llama.generate(reference.PROMPT, max_new_tokens=4, do_sample=False) as tracer:
        streams = nnsight.save([])
        for _ in tracer.iter[:4]:
            llama.ablate([0, 1], ablated * 3)  # in forward order, as every edit in a trace
            llama.cap(1, capped, min=0.5, max=1.0)
            streams.append(llama.layers[1].layer_output)
            llama.ablate(2, ablated)
        tokens = tracer.result.save()

    unit, cap_unit = ablated / ablated.norm(), capped / capped.norm()

    def hook(layer: int):
        def edit(module, args, output):
            stream = output[0] if isinstance(output, tuple) else output
            stream = projection_capped(stream, unit, 0.0, 0.0)
            if layer == 1:
                stream = projection_capped(stream, cap_unit, 0.5, 1.0)
            return (stream, *output[1:]) if isinstance(output, tuple) else stream

        return edit

    handles = [block.register_forward_hook(hook(i)) for i, block in enumerate(reference.blocks(llama_hf))]
    try:
        expected = llama_hf.generate(**reference.encode(), max_new_tokens=4, do_sample=False)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(tokens, expected)
    stream = torch.cat([step[0] for step in streams])
    close(stream @ unit, torch.zeros(len(stream)))
    assert ((stream @ cap_unit >= 0.5 - 1e-5) & (stream @ cap_unit <= 1.0 + 1e-5)).all()


def test_gradients_flow_to_standardized_values(llama):
    with llama.trace(reference.PROMPT):
        hidden = llama.layers[1].layer_output
        loss = llama.logits[0, -1].sum()
        with loss.backward():
            gradient = hidden.grad.save()
    assert gradient.shape == (1, len(reference.encode()["input_ids"][0]), llama.hidden_size)
    assert torch.count_nonzero(gradient[:, -1]) > 0


# -- methods and their checks -------------------------------------------------------


def test_logit_lens_last_layer_is_the_model_output(llama, llama_hf):
    lens = llama.logit_lens(reference.PROMPT)
    assert lens.shape == (1, llama.num_layers, llama.vocab_size)
    expected = torch.softmax(reference.run(llama_hf).logits[:, -1], dim=-1)
    close(lens[:, -1], expected)


def test_project_on_vocab_applies_gemma2_soft_capping():
    path = tiny.checkpoint("gemma2")
    model = StandardizedTransformer(path)
    assert model.config.final_logit_softcapping
    with model.trace(reference.PROMPT):
        last = model.layers[-1].layer_output
        projected = model.project_on_vocab(last).save()
        head = model.lm_head_output.save()
        logits = model.logits.save()
    close(projected, reference.run(reference.load(path)).logits, atol=1e-4)
    close(logits, projected, atol=1e-4)
    assert not torch.allclose(head, logits)


def test_topk_closest_tokens_finds_the_unembedding_row(llama):
    token = 77
    row = llama.lm_head._module.weight[token].detach()
    [closest] = llama.get_topk_closest_tokens(row, k=3)
    assert closest[0][0] == llama.tokenizer.decode([token])
    assert closest[0][1] == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="k must be an int"):
        llama.get_topk_closest_tokens(row, k=0)


def counting_forward(model):
    calls = []
    handle = model._module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls, handle


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"layers": 1, "vector": torch.zeros(7)}, r"shape \[hidden_size\] = \[128\]"),
        ({"layers": 1, "vector": torch.zeros(128, dtype=torch.int64)}, "floating dtype"),
        ({"layers": 1, "vector": torch.full((128,), float("nan"))}, "NaN or inf"),
        ({"layers": 1, "vector": torch.full((128,), float("inf"))}, "NaN or inf"),
        ({"layers": 7, "vector": torch.zeros(128)}, r"layer\(s\) \[7\] do not exist.*num_layers=3"),
        ({"layers": "1", "vector": torch.zeros(128)}, "layers must be an int"),
        ({"layers": 1, "vector": [0.0] * 128}, "must be a torch.Tensor"),
        ({"layers": 1, "vector": torch.zeros(128), "factor": float("nan")}, "factor must be a finite number"),
        ({"layers": 1, "vector": torch.zeros(128), "positions": ["a"]}, "positions must be"),
    ],
)
def test_steer_refuses_bad_arguments_before_the_model_runs(llama, kwargs, message):
    calls, handle = counting_forward(llama)
    try:
        with pytest.raises(ValueError, match=message):
            with llama.trace(reference.PROMPT):
                llama.steer(**kwargs)
                llama.logits.save()
    finally:
        handle.remove()
    assert not calls
    with llama.trace(reference.PROMPT):
        logits = llama.logits.save()
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "method, kwargs, message",
    [
        ("ablate", {"layers": 1, "vector": torch.zeros(128)}, "nonzero, finite norm"),
        ("ablate", {"layers": "every", "vector": torch.ones(128)}, "layers must be an int"),
        ("ablate", {"layers": 1, "vector": torch.ones(7)}, r"shape \[hidden_size\] = \[128\]"),
        ("ablate", {"layers": 7, "vector": torch.ones(128)}, r"layer\(s\) \[7\] do not exist.*num_layers=3"),
        ("ablate", {"layers": 1, "vector": torch.ones(128), "positions": ["a"]}, "positions must be"),
        ("cap", {"layers": 1, "vector": torch.ones(128)}, "give min, max or both"),
        ("cap", {"layers": 1, "vector": torch.ones(128), "min": 2.0, "max": 1.0}, "min must not exceed max"),
        ("cap", {"layers": 1, "vector": torch.ones(128), "max": float("nan")}, "max must be a finite number"),
        ("cap", {"layers": 1, "vector": torch.ones(128), "min": 0.0, "batch_index": "x"}, "batch"),
    ],
)
def test_ablate_and_cap_refuse_bad_arguments_before_the_model_runs(llama, method, kwargs, message):
    calls, handle = counting_forward(llama)
    try:
        with pytest.raises((ValueError, TypeError), match=message):
            with llama.trace(reference.PROMPT):
                getattr(llama, method)(**kwargs)
                llama.logits.save()
    finally:
        handle.remove()
    assert not calls
    with pytest.raises(ValueError, match="ablate is only served inside a trace"):
        llama.ablate(1, torch.ones(128))


def test_ablating_everywhere_where_a_location_cannot_be_written_is_refused_before_the_model_runs():
    model = StandardizedTransformer(tiny.checkpoint("mamba"))
    calls, handle = counting_forward(model)
    try:
        with pytest.raises(UnavailableValue, match=r"ablate\(layers='all'\) writes layers.0.attention_output"):
            with model.trace(reference.PROMPT):
                model.ablate("all", torch.ones(model.hidden_size))
                model.logits.save()
    finally:
        handle.remove()
    assert not calls


@pytest.mark.parametrize(
    "start, end, message", [(5, 5, "num_layers=3"), (2, 1, "must not come after"), (0, 9, "num_layers=3")]
)
def test_skip_layers_refuses_bad_ranges(llama, start, end, message):
    with pytest.raises(ValueError, match=message):
        with llama.trace(reference.PROMPT):
            llama.skip_layers(start, end)


def test_logit_lens_refuses_a_bad_position(llama):
    with pytest.raises(ValueError, match="position must be an int"):
        llama.logit_lens(reference.PROMPT, position="last")


def test_every_family_module_is_declared():
    from nnterp_vllm import components

    for model_type in families.known():
        family = families.lookup(model_type)
        assert isinstance(family.RENAME, dict) and family.RENAME.get is not None
        assert issubclass(family.Layer, components.Layer) and family.Layer in family.ENVOYS.values()
        for cls in set(family.ENVOYS.values()):  # vLLM's workers receive envoys by pickle
            assert issubclass(cls, components.Standard), (model_type, cls)
            assert pickle.loads(pickle.dumps(cls)) is cls
