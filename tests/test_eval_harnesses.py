"""Evaluation harnesses, unchanged, measure the steered models ``nnterp-vllm serve`` serves by name.

One server (the ``nnterp-vllm`` console script on loopback) serves a tiny llama with a registered vector file and
two steered names (``--steered-model``): ``formal``, a short-form recipe, and ``blend``, a JSON file of specs.
lm-evaluation-harness (its Python API, ``local-completions``) runs a multiple-choice task and a ``generate_until``
task written here on ``formal``; Inspect AI (its ``inspect eval`` command, ``openai-api/nnterp/blend``) runs a chat
task on ``blend``. Each harness's per-sample results and scores equal those of the same requests made by hand on
the base model with the recipe in ``extra_body``, and differ from the unsteered base model's (each harness runs
on the base name too): the harness measured the steered model.

The tiny llama's vocabulary is its byte tokenizer's (259 tokens), so every token it generates decodes to text: the
stock tiny llama's random weights mostly pick ids the tokenizer has no bytes for, whose text is empty. The targets
of the scored tasks are taken from the hand-made answers (half of them from the steered model's), so that the
scores are neither all 0 nor all 1 and steering moves them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import tiny
import torch
import yaml
from safetensors.torch import save_file
from test_serve import CHAT_TEMPLATE, ENGINE, Server

#: The base model's served name.
MODEL = "tiny"
#: The server's API key (--api-key): lm-eval sends OPENAI_API_KEY's, Inspect SERVICE_API_KEY's.
KEY = "harness-key"
#: The registered vectors: unit directions, so that a factor is the size of what steering adds.
VECTOR_NAMES = ("formal", "casual")
#: Each steered name's recipe as given to --steered-model, and the same steering as a request's field.
FORMAL = "formal@1:1.0"
FORMAL_SPECS = [{"layers": 1, "vector": "formal", "factor": 1.0}]
BLEND_SPECS = [
    {"layers": [0, 1], "vector": "casual", "factor": 0.5},
    {"layers": 2, "vector": "formal", "factor": -2.0, "positions": "generated"},
]
#: lm-eval's multiple-choice documents (the gold answers are set from the hand-made loglikelihoods).
CHOICE_DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "loud"]},
    {"question": "Two plus two is", "choices": ["four", "five"]},
    {"question": "Water boils at", "choices": ["one hundred degrees", "zero degrees", "noon"]},
    {"question": "A cat says", "choices": ["meow", "woof"]},
]
#: lm-eval's generate_until prompts, and its generation settings (mirrored by hand).
GENERATE_PROMPTS = ["The sky is", "Once upon a time", "Water boils at", "My favourite food is"]
UNTIL = ["\n"]
MAX_GEN_TOKS = 8
#: What lm-eval's local-completions sends with every request.
LM_EVAL_SEED = 1234
#: Inspect's chat samples and its generation settings.
CHAT_INPUTS = ["Name a colour.", "Say hi.", "What is two plus two?", "Tell me a story."]
CHAT_MAX_TOKENS = 8
#: A target no answer of the tiny model holds.
NO_ANSWER = "zebra crossing"
#: The OpenAI-compatible service name Inspect is given (openai-api/SERVICE/NAME): it reads SERVICE_BASE_URL and
#: SERVICE_API_KEY.
SERVICE = "nnterp"
#: Seconds one harness run may take.
HARNESS_SECONDS = 300


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server: the tiny llama in float32, the vectors from a file, ``formal`` by its short form, ``blend`` from a
    JSON recipe file, a chat template for the chat route."""
    path = tiny.checkpoint("llama", vocab_size=259)
    directory = tmp_path_factory.mktemp("harness-server")
    generator = torch.Generator().manual_seed(11)
    directions = {name: torch.randn(tiny.SIZES["hidden_size"], generator=generator) for name in VECTOR_NAMES}
    vectors = directory / "vectors.safetensors"
    save_file({name: (vector / vector.norm()).contiguous() for name, vector in directions.items()}, str(vectors))
    recipe = directory / "blend.json"
    recipe.write_text(json.dumps(BLEND_SPECS))
    (directory / "chat.jinja").write_text(CHAT_TEMPLATE)
    arguments = [str(path), "--served-model-name", MODEL, "--steering-vectors", str(vectors)]
    arguments += ["--steered-model", f"formal={FORMAL}", f"blend={recipe}"]
    arguments += ["--chat-template", str(directory / "chat.jinja"), "--api-key", KEY]
    arguments += [f"--{key.replace('_', '-')}={value}" for key, value in ENGINE.items()]
    # Built eagerly: the harnesses' subject is the steered names, each held equal to its recipe sent by hand to the
    # same server; the compiled engine's steering is held equal to transformers by tests/test_serve.py.
    arguments += ["--enforce-eager"]
    server = Server(arguments, directory / "server.log")
    try:
        server.wait_ready()
        yield SimpleNamespace(
            url=server.url,
            path=path,
            tokenizer=tiny.tokenizer(),
            client=openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60),
            log=server.log,
        )
    finally:
        assert server.stop() == 0, server.log.read_text()[-3000:]


def steering_body(specs: list[dict]) -> dict:
    """A request's ``extra_body``: the recipe's steering, or nothing (the unsteered base model)."""
    return {"extra_body": {"steering": specs}} if specs else {}


def test_the_steered_names_are_listed_with_the_base_model_as_parent(served):
    listed = {card.id: card for card in served.client.models.list().data}
    assert set(listed) == {MODEL, "formal", "blend"}
    assert listed["formal"].parent == listed["blend"].parent == MODEL


# lm-evaluation-harness


def loglikelihood(served, specs: list[dict], context: str, continuation: str) -> tuple[float, bool]:
    """A continuation's loglikelihood and whether greedy decoding would produce it, asked as lm-eval's
    ``local-completions`` asks (`TemplateLM._encode_pair`, `LocalCompletionsAPI._create_payload` and
    ``parse_logprobs``): the whole text's tokens echoed with one token generated, the continuation's log
    probabilities summed."""
    whole = served.tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_length = len(served.tokenizer(context, add_special_tokens=False).input_ids)
    response = served.client.completions.create(
        model=MODEL,
        prompt=whole,
        temperature=0,
        max_tokens=1,
        logprobs=1,
        seed=LM_EVAL_SEED,
        echo=True,
        **steering_body(specs),
    )
    logprobs = response.choices[0].logprobs
    scored = logprobs.token_logprobs[context_length:-1]
    tops = logprobs.top_logprobs[context_length:-1]
    return sum(scored), all(token == max(top.values()) for token, top in zip(scored, tops))


def generated(served, specs: list[dict], context: str) -> str:
    """A generate_until answer asked as ``local-completions`` asks: the context's tokens, greedy, stopped at the
    task's ``until`` and the tokenizer's end-of-sequence text."""
    response = served.client.completions.create(
        model=MODEL,
        prompt=served.tokenizer(context, add_special_tokens=False).input_ids,
        max_tokens=MAX_GEN_TOKS,
        temperature=0,
        stop=[*UNTIL, served.tokenizer.eos_token],
        seed=LM_EVAL_SEED,
        **steering_body(specs),
    )
    return response.choices[0].text


def by_hand(served, specs: list[dict]) -> SimpleNamespace:
    """Every loglikelihood (per document, per choice) and generation the two lm-eval tasks ask for, asked by hand."""
    choices = [
        [loglikelihood(served, specs, doc["question"], " " + choice) for choice in doc["choices"]]
        for doc in CHOICE_DOCS
    ]
    return SimpleNamespace(
        choices=choices, generations=[generated(served, specs, prompt) for prompt in GENERATE_PROMPTS]
    )


def likeliest(choices: list[tuple[float, bool]]) -> int:
    """The choice with the highest loglikelihood (the first of equals, as lm-eval's ``acc`` takes it)."""
    return max(range(len(choices)), key=lambda choice: choices[choice][0])


def unlikeliest(choices: list[tuple[float, bool]]) -> int:
    return min(range(len(choices)), key=lambda choice: choices[choice][0])


def write_lm_eval_tasks(directory: Path, golds: list[int], targets: list[str]) -> None:
    """The two tasks, as YAML files over jsonl data (no hub): ``steer_choice`` (multiple_choice, acc) and
    ``steer_generate`` (generate_until, exact_match)."""
    rows = [{**doc, "answer": gold} for doc, gold in zip(CHOICE_DOCS, golds)]
    (directory / "choice.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    rows = [{"prompt": prompt, "target": target} for prompt, target in zip(GENERATE_PROMPTS, targets)]
    (directory / "generate.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = {"dataset_path": "json", "test_split": "test"}
    cache = str(directory / "datasets-cache")
    tasks = {
        "steer_choice": {
            **common,
            "dataset_kwargs": {"data_files": {"test": str(directory / "choice.jsonl")}, "cache_dir": cache},
            "output_type": "multiple_choice",
            "doc_to_text": "question",
            "doc_to_choice": "choices",
            "doc_to_target": "answer",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        },
        "steer_generate": {
            **common,
            "dataset_kwargs": {"data_files": {"test": str(directory / "generate.jsonl")}, "cache_dir": cache},
            "output_type": "generate_until",
            "doc_to_text": "prompt",
            "doc_to_target": "target",
            "generation_kwargs": {"until": UNTIL, "max_gen_toks": MAX_GEN_TOKS, "temperature": 0.0, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        },
    }
    for name, config in tasks.items():
        (directory / f"{name}.yaml").write_text(yaml.safe_dump({"task": name, **config}, allow_unicode=True))


def lm_eval_run(served, name: str, directory: Path) -> dict:
    """lm-eval's own run of the two tasks on the served ``name``, samples logged. Its model arguments are the
    guide's (the tokenizer left to lm-eval's ``auto``, which takes the one named, the server having no
    ``/tokenizer_info``), with ``max_length`` the server's ``--max-model-len``."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_args = f"base_url={served.url}/v1/completions,model={name},tokenizer={served.path}"
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"{model_args},max_length={ENGINE['max_model_len']},timeout={HARNESS_SECONDS}",
        tasks=["steer_choice", "steer_generate"],
        task_manager=TaskManager(include_path=str(directory), include_defaults=False),
        log_samples=True,
    )


def lm_eval_answers(results: dict) -> SimpleNamespace:
    """The per-sample answers lm-eval logged, in document order, and its scores."""
    samples = {task: sorted(results["samples"][task], key=lambda s: s["doc_id"]) for task in results["samples"]}
    return SimpleNamespace(
        choices=[[tuple(r) for r in sample["filtered_resps"]] for sample in samples["steer_choice"]],
        generations=[sample["filtered_resps"][0] for sample in samples["steer_generate"]],
        acc=results["results"]["steer_choice"]["acc,none"],
        exact_match=results["results"]["steer_generate"]["exact_match,none"],
    )


def test_lm_eval_on_a_steered_name_scores_as_its_recipe_sent_by_hand(served, tmp_path, monkeypatch):
    """lm-eval's local-completions on ``formal``: per-sample loglikelihoods (and greediness), generations, accuracy
    and exact match equal the same requests made by hand on the base model with ``formal``'s recipe in
    ``extra_body``; on the base name, lm-eval's answers are the unsteered ones, and differ."""
    steered, base = by_hand(served, FORMAL_SPECS), by_hand(served, [])
    # Gold answers: the steered model's likeliest choice for half the documents, its least likely for the others;
    # generation targets: the steered model's answer for half the prompts. Its scores are then 0.5 and 0.5.
    golds = [likeliest(lls) if i % 2 == 0 else unlikeliest(lls) for i, lls in enumerate(steered.choices)]
    targets = [text if i % 2 == 0 else NO_ANSWER for i, text in enumerate(steered.generations)]
    write_lm_eval_tasks(tmp_path, golds, targets)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    scores = {}
    for name, hand in (("formal", steered), (MODEL, base)):
        found = lm_eval_answers(lm_eval_run(served, name, tmp_path))
        assert len(found.choices) == len(CHOICE_DOCS) and len(found.generations) == len(GENERATE_PROMPTS)
        for doc, (got, expected) in enumerate(zip(found.choices, hand.choices)):
            assert [greedy for _, greedy in got] == [greedy for _, greedy in expected], (name, doc)
            assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in expected], rel=1e-5, abs=1e-5), (name, doc)
        assert found.generations == hand.generations, name
        acc = sum(likeliest(lls) == gold for lls, gold in zip(hand.choices, golds)) / len(golds)
        exact = sum(text == target for text, target in zip(hand.generations, targets)) / len(targets)
        scores[name] = (found.acc, found.exact_match)
        assert scores[name] == pytest.approx((acc, exact)), name
    assert scores["formal"] == (0.5, 0.5)
    # Steering applied: every document's loglikelihoods, the generations and the scores moved.
    for doc, (got, unsteered) in enumerate(zip(steered.choices, base.choices)):
        assert [ll for ll, _ in got] != pytest.approx([ll for ll, _ in unsteered], abs=1e-3), doc
    assert steered.generations != base.generations
    assert scores["formal"] != scores[MODEL]


# Inspect AI


def chat_answer(served, specs: list[dict], content: str) -> tuple[str, list[float]]:
    """A chat completion asked as Inspect's ``openai-api`` provider asks for one (the sample's input as the user's
    message; greedy, ``max_tokens`` and ``logprobs`` from the run's settings): its text and its tokens' log
    probabilities."""
    response = served.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=CHAT_MAX_TOKENS,
        temperature=0,
        logprobs=True,
        **steering_body(specs),
    )
    choice = response.choices[0]
    return choice.message.content or "", [token.logprob for token in choice.logprobs.content]


INSPECT_TASK = """
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import generate

SAMPLES = {samples!r}


@task
def steered_chat():
    return Task(
        dataset=[Sample(id=i, input=text, target=target) for i, (text, target) in enumerate(SAMPLES)],
        solver=generate(),
        scorer=includes(),
    )
"""


def test_inspect_on_a_steered_name_scores_as_its_recipe_sent_by_hand(served, tmp_path):
    """``inspect eval`` with ``openai-api/nnterp/blend`` (base URL and key from its environment): per-sample
    completions, their tokens' log probabilities, scores and the accuracy equal hand-made chat completions on the
    base model with ``blend``'s recipe (a JSON file) in ``extra_body``; the base name's run answers unsteered, and
    differs."""
    steered, steered_logprobs = zip(*(chat_answer(served, BLEND_SPECS, text) for text in CHAT_INPUTS))
    base, base_logprobs = zip(*(chat_answer(served, [], text) for text in CHAT_INPUTS))
    assert steered != base
    targets = [answer if i % 2 == 0 and answer.strip() else NO_ANSWER for i, answer in enumerate(steered)]
    task = tmp_path / "steered_chat.py"
    task.write_text(INSPECT_TASK.format(samples=list(zip(CHAT_INPUTS, targets))))
    names = {"blend": (steered, steered_logprobs), MODEL: (base, base_logprobs)}
    env = {
        **os.environ,
        f"{SERVICE.upper()}_BASE_URL": f"{served.url}/v1",
        f"{SERVICE.upper()}_API_KEY": KEY,
        # Inspect's own data and cache directories (traces, sample buffers) in the test's directory.
        "XDG_DATA_HOME": str(tmp_path / "data"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    # Relative: inspect eval refuses an absolute path to a task file.
    command = [str(Path(sys.executable).with_name("inspect")), "eval", task.name]
    command += ["--model", ",".join(f"openai-api/{SERVICE}/{name}" for name in names)]
    command += ["--temperature", "0", "--max-tokens", str(CHAT_MAX_TOKENS), "--logprobs"]
    command += ["--log-dir", str(tmp_path / "logs"), "--display", "none"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=HARNESS_SECONDS, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    from inspect_ai.log import list_eval_logs, read_eval_log

    logs = [read_eval_log(info) for info in list_eval_logs(str(tmp_path / "logs"))]
    assert sorted(log.eval.model for log in logs) == sorted(f"openai-api/{SERVICE}/{name}" for name in names)
    accuracy = {}
    for log in logs:
        name = log.eval.model.rsplit("/", 1)[1]
        assert log.status == "success", (name, log.error)
        samples = sorted(log.samples, key=lambda sample: sample.id)
        answers, logprobs = names[name]
        assert [sample.output.completion for sample in samples] == list(answers), name
        for sample, expected in zip(samples, logprobs):
            found = [token.logprob for token in sample.output.choices[0].logprobs.content]
            assert found == pytest.approx(expected, rel=1e-5, abs=1e-5), (name, sample.id)
        expected = [target.casefold() in answer.casefold() for answer, target in zip(answers, targets)]
        assert [sample.scores["includes"].value == "C" for sample in samples] == expected, name
        (score,) = log.results.scores
        accuracy[name] = score.metrics["accuracy"].value
        assert accuracy[name] == pytest.approx(sum(expected) / len(expected)), name
    assert accuracy["blend"] != accuracy[MODEL]
