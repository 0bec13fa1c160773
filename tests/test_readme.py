"""README.md's commands and examples are true."""

from __future__ import annotations

import ast
import os
import re

import pytest
from doc_examples import README, ROOT, page_examples, readme_examples, run_example
from test_serve import Server

from nnterp_vllm.checkpoints import smollm2

README_TEXT = README.read_text()
#: Every example of the README and of the site's pages, each once: the README's short examples are the pages'.
EXAMPLES = page_examples()
EXAMPLES.update({f"README.md:{i}": e for i, e in enumerate(readme_examples()) if e not in EXAMPLES.values()})
#: The README's own examples, which no page holds: run here (the pages' are run by tests/test_docs.py).
README_ONLY = sorted(key for key in EXAMPLES if key.startswith("README.md:"))
#: The nnterp helpers an example calls that take ``remote=``.
REMOTE_HELPERS = {"logit_lens", "patchscope_lens", "patchscope_generate", "get_token_activations"}
#: The examples whose traces are also run as sent elsewhere, each found by a line only it has: the first trace,
#: the experiment on both engines, nnterp's helpers.
SENT_EXAMPLES = {
    "first-trace": 'print(model.support()["self_attn.attention_probabilities"])',
    "both-engines": "def experiment(model, vector):",
    "nnterp-helpers": 'patched = patchscope_lens(model, "The Eiffel Tower", layers=[5, 15])',
}
SEEDED = "import torch\ntorch.manual_seed(0)\n"
#: vLLM's log lines, which it writes to standard output.
VLLM_LOG = re.compile(r"^(\(\S+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d ")
#: The README stays a front door: what it is, the two commands, a short example per job, links into the docs.
MOST_LINES = 200


def traced_calls(tree: ast.AST) -> list[ast.Call]:
    """The calls that open a trace or a generation as a ``with`` item (``with model.trace(...)``)."""
    calls = [item.context_expr for node in ast.walk(tree) if isinstance(node, ast.With) for item in node.items]
    calls = [call for call in calls if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)]
    return [call for call in calls if call.func.attr in ("trace", "generate")]


def sent_as_remote(source: str) -> str:
    """``source`` with every trace and generation it opens, and every nnterp helper it calls, given
    ``remote="local"``: serialized and rebuilt as a server with this library installed would, then run here."""
    tree = ast.parse(source)
    calls = traced_calls(tree) + [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in REMOTE_HELPERS
    ]
    assert calls, "the example sends nothing"
    for call in calls:
        call.keywords.append(ast.keyword("remote", ast.Constant("local")))
    return ast.unparse(ast.fix_missing_locations(tree))


def sent_to_server(source: str, url: str) -> str:
    """``source`` with every trace and generation it opens on a `StandardizedVLLM` sent to the trace server at
    ``url`` (``serve=url``); those on transformers run here (``serve=None``)."""
    tree = ast.parse(source)
    for call in traced_calls(tree):
        served = ast.parse(f"{url!r} if isinstance(model, StandardizedVLLM) else None", mode="eval").body
        served.test.args[0] = call.func.value
        call.keywords.append(ast.keyword("serve", served))
    return ast.unparse(ast.fix_missing_locations(tree))


def test_readme_names_two_commands_that_the_makefile_has():
    commands = re.findall(r"```bash\n(.*?)```", README_TEXT, re.S)
    assert [c.strip() for c in commands] == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndemo:" in makefile and "\ntest:" in makefile
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_readme_is_short_and_its_links_lead_to_files():
    assert len(README_TEXT.splitlines()) < MOST_LINES
    links = re.findall(r"\]\(([^)#]+)(#[^)]*)?\)", README_TEXT)
    local = [target for target, _ in links if "://" not in target]
    assert local and all((ROOT / target).exists() for target in local), [t for t in local if not (ROOT / t).exists()]


@pytest.mark.parametrize("key", README_ONLY)
def test_readme_example_runs(key, tmp_path):
    result = run_example(EXAMPLES[key], tmp_path / "example.py")
    assert result.returncode == 0, result.stderr[-3000:]
    for mistake in ("TraceNeverRan", "ParameterWritten"):  # the examples make none of the mistakes caught
        assert mistake not in result.stderr, result.stderr[-3000:]


def printed_lines(runs: list) -> list[list[str]]:
    """What each run printed (vLLM's log lines left out), once every run exited cleanly."""
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    return [[line for line in run.stdout.splitlines() if not VLLM_LOG.match(line)] for run in runs]


@pytest.mark.parametrize("name", sorted(SENT_EXAMPLES))
def test_readme_example_traces_sent_elsewhere_print_what_they_print_here(name, tmp_path):
    """Sent with ``remote="local"``: serialized and rebuilt as a server would, then run here."""
    (example,) = [source for source in EXAMPLES.values() if SENT_EXAMPLES[name] in source]
    in_process = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    runs = [
        run_example(SEEDED + example, tmp_path / "here.py", in_process),
        run_example(SEEDED + sent_as_remote(example), tmp_path / "sent.py", in_process),
    ]
    printed = printed_lines(runs)
    assert printed[0] and printed[1] == printed[0], printed


@pytest.mark.slow
def test_readme_example_on_both_engines_prints_the_same_with_its_vllm_traces_served(tmp_path):
    """The experiment on both engines with its vLLM traces sent to ``nnterp-vllm serve --traces`` serving the
    example's model on loopback (minutes: the server compiles its engines)."""
    (example,) = [source for source in EXAMPLES.values() if SENT_EXAMPLES["both-engines"] in source]
    assert "StandardizedVLLM(smollm2()" in example
    runs = [run_example(SEEDED + example, tmp_path / "here.py", {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})]
    arguments = [str(smollm2()), "--traces", "--dtype", "float32", "--max-model-len", "512"]
    server = Server(arguments, tmp_path / "server.log")
    try:
        server.wait_ready()
        runs.append(run_example(SEEDED + sent_to_server(example, server.url), tmp_path / "served.py"))
        assert 'POST /v1/nnsight/generate HTTP/1.1" 200' in server.log.read_text()
        served = runs[-1].stdout + runs[-1].stderr
        assert "init engine" not in served  # no vLLM engine started beside the server: every trace was sent
    finally:
        assert server.stop() == 0
    printed = printed_lines(runs)
    assert printed[0] and printed[1] == printed[0], printed
