"""One dtype rule: a checkpoint loads in its own dtype on both engines unless the caller names another."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tiny
import torch

from nnterp_vllm import StandardizedTransformer, dtypes
from nnterp_vllm.checkpoints import read_config
from nnterp_vllm.cli import main
from nnterp_vllm.engines.engine_defaults import engine_kwargs
from nnterp_vllm.harvest import harvest

PROMPT = "the quick brown fox"
VALUES = ["layers.*.layer_output"]
DOCS = ["the quick brown fox jumps over the lazy dog", "seven wizards hex bold jumping zebras"]


@pytest.fixture(scope="module")
def fp32_path() -> Path:
    return tiny.checkpoint("llama")


@pytest.fixture(scope="module")
def bf16_path(fp32_path, tmp_path_factory) -> Path:
    """The tiny llama saved in bfloat16: its config says bfloat16, its weights are stored so."""
    from transformers import AutoModelForCausalLM

    target = tmp_path_factory.mktemp("bf16") / "llama-bf16"
    AutoModelForCausalLM.from_pretrained(fp32_path, dtype=torch.bfloat16).save_pretrained(target)
    for tokenizer_file in fp32_path.glob("*token*"):
        shutil.copy(tokenizer_file, target)
    assert json.loads((target / "config.json").read_text())["dtype"] == "bfloat16"
    return target


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


# ------------------------------------------------------------------------------------------------ the rule


def test_the_checkpoints_own_dtype(fp32_path, bf16_path, tmp_path):
    assert dtypes.checkpoint_dtype(read_config(fp32_path), fp32_path) == torch.float32
    assert dtypes.checkpoint_dtype(read_config(bf16_path), bf16_path) == torch.bfloat16
    # A config naming no dtype: the weights' dtype, else float32.
    config = read_config(bf16_path)
    config.dtype = None
    assert dtypes.checkpoint_dtype(config, bf16_path) == torch.bfloat16
    assert dtypes.checkpoint_dtype(config, tmp_path) == torch.float32


def test_vllm_engine_arguments_follow_the_rule(fp32_path, bf16_path):
    # vLLM's own "auto" would run the float32 checkpoint in bfloat16.
    assert engine_kwargs(str(fp32_path))["dtype"] == "float32"
    assert engine_kwargs(str(bf16_path))["dtype"] == "bfloat16"
    assert engine_kwargs(str(bf16_path), dtype="auto")["dtype"] == "bfloat16"
    taken = engine_kwargs(str(fp32_path), torch_dtype=torch.float16)
    assert taken["dtype"] == "float16" and "torch_dtype" not in taken
    assert engine_kwargs(str(bf16_path), dtype="half")["dtype"] == "float16"
    # The server's engine (`nnterp-vllm serve`, `AsyncSteeredVLLM`): vLLM's --dtype, "auto" by default.
    from vllm.engine.arg_utils import AsyncEngineArgs

    from nnterp_vllm.engines.steered.steered_settings import steered_engine_args

    assert steered_engine_args(AsyncEngineArgs(model=str(fp32_path))).dtype == "float32"
    assert steered_engine_args(AsyncEngineArgs(model=str(bf16_path), dtype="float16")).dtype == "float16"


@pytest.mark.parametrize(
    ("kwargs", "engine", "message"),
    [
        ({"dtype": "bf16"}, "vllm", "dtype must name a torch dtype the vllm engine loads a model in: 'auto'"),
        ({"dtype": "int8"}, "vllm", "vLLM quantizes with quantization="),
        ({"dtype": torch.float64}, "vllm", "vLLM runs no float64 model"),
        ({"dtype": torch.int32}, "transformers", "int32 is no dtype a model's weights compute in"),
        ({"torch_dtype": 16}, "transformers", "torch_dtype must name a torch dtype"),
        ({"dtype": "float32", "torch_dtype": "bfloat16"}, "transformers", "two spellings of one argument"),
    ],
)
def test_a_bad_dtype_is_refused_with_what_would_do(fp32_path, kwargs, engine, message):
    with pytest.raises(ValueError, match="'float32', 'bfloat16', 'float16'|two spellings") as raised:
        dtypes.load_dtype(fp32_path, read_config(fp32_path), dict(kwargs), engine)
    assert message in str(raised.value)


def test_bad_dtypes_are_refused_before_anything_loads(fp32_path):
    from nnterp_vllm import StandardizedVLLM
    from nnterp_vllm.engines.steered.engine import SteeredVLLM

    with pytest.raises(ValueError, match="got 'float99'"):
        StandardizedTransformer(fp32_path, dtype="float99")
    with pytest.raises(ValueError, match="vLLM runs no float64 model"):
        StandardizedVLLM(fp32_path, dtype="float64")
    with pytest.raises(ValueError, match="torch_dtype must name a torch dtype the vllm engine"):
        SteeredVLLM(fp32_path, torch_dtype="fp8-ish")


# ---------------------------------------------------------------------------------------------- the engines


def test_transformers_loads_the_checkpoints_dtype_unless_told(fp32_path, bf16_path):
    assert StandardizedTransformer(fp32_path).dtype == torch.float32
    assert StandardizedTransformer(bf16_path).dtype == torch.bfloat16
    assert StandardizedTransformer(bf16_path, dtype="float32").dtype == torch.float32
    assert StandardizedTransformer(fp32_path, torch_dtype=torch.bfloat16).dtype == torch.bfloat16
    assert StandardizedTransformer(fp32_path, dtype="auto", dispatch=False).dtype == torch.float32


def test_a_loaded_model_keeps_its_dtype(fp32_path):
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(fp32_path)
    assert StandardizedTransformer(module, dtype="float32").dtype == torch.float32
    with pytest.raises(ValueError, match=r"already loaded, in float32.*module.to\(torch.bfloat16\)"):
        StandardizedTransformer(module, dtype="bfloat16")


def test_vllm_loads_what_transformers_loads(fp32_path, bf16_path):
    """The same call on both engines: the same dtype, and (float32 here) the same values."""
    from nnterp_vllm import StandardizedVLLM

    hf = StandardizedTransformer(fp32_path)
    with hf.trace(PROMPT):
        expected = hf.layers[2].layer_output.save()
    on_vllm = StandardizedVLLM(fp32_path)
    try:
        assert on_vllm.dtype == torch.float32
        with on_vllm.trace(PROMPT):
            got = on_vllm.layers[2].layer_output.save()
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    finally:
        on_vllm.shutdown()
    for kwargs, dtype in (({}, torch.bfloat16), ({"dtype": "float32"}, torch.float32)):
        on_vllm = StandardizedVLLM(bf16_path, **kwargs)
        try:
            assert on_vllm.dtype == dtype == StandardizedTransformer(bf16_path, **kwargs).dtype
            with on_vllm.trace(PROMPT):
                out = on_vllm.layers[0].layer_output.save()
            assert out.dtype == dtype
        finally:
            on_vllm.shutdown()


def test_the_steered_engine_follows_the_rule(bf16_path):
    from nnterp_vllm.engines.steered.engine import SteeredVLLM

    llm = SteeredVLLM(bf16_path, torch_dtype="float32")
    try:
        assert llm.dtype == torch.float32 == llm.vllm_config.model_config.dtype
    finally:
        llm.shutdown()


# ----------------------------------------------------------------------------------------- harvest and CLI


def test_both_engines_harvest_a_bfloat16_checkpoint_in_bfloat16(bf16_path, tmp_path):
    """The same harvest call on both engines: the manifest says the model ran in bfloat16 on each."""
    hf = harvest(bf16_path, DOCS, VALUES, tmp_path / "hf", engine="hf", progress=False)
    on_vllm = harvest(bf16_path, DOCS, VALUES, tmp_path / "vllm", engine="vllm", progress=False)
    for result in (hf, on_vllm):
        assert result.manifest["model_dtype"] == "bfloat16" and result.manifest["dtype"] == "bfloat16"
    assert on_vllm.manifest["vllm_path"] == "engine"  # a SteeredVLLM built for the harvest
    for layer in range(3):
        name = f"layers.{layer}.layer_output"
        torch.testing.assert_close(on_vllm.load(name).float(), hf.load(name).float(), atol=0.1, rtol=0.05)


@pytest.mark.slow
def test_the_cli_records_the_model_dtype_and_resumes_only_with_it(bf16_path, fp32_path, tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in DOCS))

    def run(model: Path, out: str, *extra: str) -> int:
        arguments = ["harvest", str(model), "--corpus", str(corpus), "--values", *VALUES, "--out", str(tmp_path / out)]
        return main([*arguments, "--quiet", *extra])

    assert run(bf16_path, "hf") == 0
    assert manifest(tmp_path / "hf")["model_dtype"] == "bfloat16"
    assert run(fp32_path, "vllm", "--engine", "vllm") == 0  # float32, as transformers loads it
    assert manifest(tmp_path / "vllm")["model_dtype"] == "float32"
    assert run(bf16_path, "told", "--engine", "vllm", "--model-dtype", "float32") == 0
    assert manifest(tmp_path / "told")["model_dtype"] == "float32"
    capsys.readouterr()
    # Resuming with the model in another dtype is refused (the stored dtype named the same).
    assert run(bf16_path, "hf", "--dtype", "bfloat16", "--model-dtype", "float32") == 2
    assert "model_dtype: directory has 'bfloat16', this run has 'float32'" in capsys.readouterr().err
    # A directory from before the model's dtype was recorded resumes.
    recorded = manifest(tmp_path / "hf")
    del recorded["model_dtype"]
    (tmp_path / "hf" / "manifest.json").write_text(json.dumps(recorded))
    assert run(bf16_path, "hf") == 0
    assert run(bf16_path, "bad", "--engine", "vllm", "--model-dtype", "float64") == 2
    assert "--model-dtype must name a torch dtype the vllm engine loads" in capsys.readouterr().err
