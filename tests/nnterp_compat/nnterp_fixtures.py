"""The fixtures nnterp 1.3.0's tests ask for, offline: loaded with ``pytest -p nnterp_fixtures`` in place of
nnterp's own conftest (which lists models on the hub).

``model_name`` is a tiny checkpoint (``tests/tiny.py``) or SmolLM2; ``model`` is nnterp_vllm's model of it
on the engine under test (``NNTERP_COMPAT_ENGINE``). A test that cannot apply is marked skipped with the
reason, prefixed `NOT_APPLICABLE`; `not_applicable` lists them.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest  # noqa: E402
import tiny  # noqa: E402

from nnterp_vllm.checkpoints import smollm2  # noqa: E402

# The shim (``import nnterp``) loads nnsight, which gives every object a ``save``; it is imported by the
# fixtures, after pytest's other plugins (anyio's refuses classes with such an attribute).
ENGINE = os.environ.get("NNTERP_COMPAT_ENGINE", "transformers")


def tiny_with_smollm2_tokenizer() -> Path:
    """A tiny random llama with SmolLM2's tokenizer (vocabulary and chat template): a real tokenizer at tiny cost."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2())
    weights = tiny.checkpoint("llama", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    path = weights.with_name(f"{weights.name}-smollm2-tokenizer")
    if not (path / "tokenizer_config.json").exists():
        staging = path.with_name(f"{path.name}.tmp{os.getpid()}")
        shutil.copytree(weights, staging, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
        tokenizer.save_pretrained(staging)
        staging.rename(path)
    return path


#: The checkpoints ``model_name`` takes, by test id: tiny models of llama's and GPT-2's layouts, and a
#: tiny llama with a real tokenizer (SmolLM2's, with its chat template); SmolLM2 itself, real weights.
MODELS = {
    "llama": lambda: tiny.checkpoint("llama"),
    "gpt2": lambda: tiny.checkpoint("gpt2"),
    "llama-smollm2-tokenizer": tiny_with_smollm2_tokenizer,
    "smollm2": smollm2,
}
#: ``model_name``'s checkpoints.
TEST_MODELS = ("llama", "gpt2", "llama-smollm2-tokenizer")
#: ``llama_like_model_name``'s checkpoints: transformers' llama layout (nnterp's tests load them with
#: nnsight's own LanguageModel).
LLAMA_LIKE = ("llama", "smollm2")
#: The prefix of every skip reason given here.
NOT_APPLICABLE = "not applicable: "

RAW_OUTPUTS = (
    "compares native module outputs/inputs (model.layers[i].output, model.output.logits) with transformers'; "
    "on vLLM those are the engine's own flat (hidden, residual) tensors, and the standardized values "
    "(layers_output[i], logits) are what equals transformers"
)
BATCH = "puts a batch of prompts in one invoke; vLLM serves one prompt per invoke"
PATTERN = "needs the attention pattern, which vLLM computes inside its fused kernel and never materializes"
BACKBONE = (
    "reaches GPT-2's modules as model.model.* (nnterp renames the backbone `transformer` to `model`); "
    "nnterp_vllm keeps native paths and puts the standard names at the root (model.layers, model.ln_final)"
)
NNSIGHT_ONLY = "runs on nnsight's own LanguageModel (transformers) only, not on an nnterp_vllm engine"

#: ``{(test function, engine or None for both, model id or None for all): reason}``.
REASONS: dict[tuple[str, str | None, str | None], str] = {
    ("test_print_attn_probabilities_source", "vllm", None): PATTERN,
    ("test_standardized_transformer_steer_method", None, None): (
        "asserts that steer(positions=...) is deprecated (nnterp 1.3's decision); in nnterp_vllm positions= is "
        "the primary spelling and token_positions= its nnterp alias, neither deprecated"
    ),
    ("test_model_renaming_activations_diff", "transformers", None): (
        "reads `._model` of nnsight's own LanguageModel, nnsight's name for the wrapped module before 0.8 "
        "(nnsight 0.8 calls it `_module`)"
    ),
    **{
        (name, "transformers", "gpt2"): BACKBONE
        for name in (
            "test_renaming_forward",
            "test_standardized_transformer_methods",
            "test_standardized_transformer_input_accessors",
            "test_module_accessor",
        )
    },
    **{(name, "vllm", None): PATTERN for name in ("test_access_attn_probabilities", "test_edit_attn_probabilities")},
    **{
        (name, "vllm", None): RAW_OUTPUTS
        for name in (
            "test_model_renaming_activations_diff",
            "test_renaming_forward",
            "test_standardized_transformer_methods",
            "test_renamed_model_methods",
            "test_standardized_transformer_input_accessors",
        )
    },
    **{
        (name, "vllm", None): BATCH
        for name in (
            "test_steer_batch_index",
            "test_steer_batch_index_and_token_positions",
            "test_standardized_transformer_properties",
        )
    },
    **{
        (name, "vllm", None): NNSIGHT_ONLY
        for name in (
            "test_load_model",
            "test_basic_utils",
            "test_activation_collection",
            "test_project_on_vocab_layer_output_backward",
            "test_grad_from_mlp",
            "test_cache_with_renamed_modules",
            "test_module_accessor",
        )
    },
}


def not_applicable(function: str, engine: str, model: str | None) -> str | None:
    """Why the test ``function`` on ``model`` cannot apply on ``engine`` (``None``: it applies)."""
    for (name, on, only), reason in REASONS.items():
        if name == function and on in (None, engine) and only in (None, model):
            return reason
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Module scope groups each file's tests by checkpoint, so a vLLM engine is built once per file and model.
    for argument, names in (("model_name", TEST_MODELS), ("llama_like_model_name", LLAMA_LIKE)):
        if argument in metafunc.fixturenames:
            metafunc.parametrize(argument, [str(MODELS[name]()) for name in names], ids=names, scope="module")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        model = item.callspec.id if hasattr(item, "callspec") else None
        reason = not_applicable(item.originalname, ENGINE, model)
        if reason:
            item.add_marker(pytest.mark.skip(reason=NOT_APPLICABLE + reason))


@pytest.fixture
def model(model_name: str) -> object:
    """nnterp's ``model`` fixture: the checkpoint as nnterp_vllm's model on the engine under test."""
    import nnterp

    return nnterp.StandardizedTransformer(model_name)


@pytest.fixture
def raw_model(model_name: str) -> object:
    """nnterp's ``raw_model`` fixture: the checkpoint as nnsight's own LanguageModel, its wrapped module also
    under ``_model`` (nnsight's name for it before 0.8, which nnterp's tests read)."""
    from nnsight import LanguageModel

    class WithModel(LanguageModel):
        @property
        def _model(self) -> object:
            return self._module

    return WithModel(model_name, device_map="auto")


@pytest.fixture(scope="session", autouse=True)
def engines_shut_down():
    """Shut down the engines the tests built, and remove the files vLLM leaves, when the session ends."""
    directory = tempfile.mkdtemp(prefix="nnterp-compat-rpc-")
    os.environ["VLLM_RPC_BASE_PATH"] = directory
    shared_before = set(glob.glob("/dev/shm/vllm_*"))
    yield
    if "nnterp" in sys.modules:
        sys.modules["nnterp"].shutdown()
    shutil.rmtree(directory, ignore_errors=True)
    for leftover in set(glob.glob("/dev/shm/vllm_*")) - shared_before:
        os.remove(leftover)
