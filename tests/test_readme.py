"""README.md's commands and examples are true."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_serve import Server

from nnterp_vllm.checkpoints import smollm2

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```", README, re.S)
#: The nnterp helpers an example calls that take ``remote=``.
REMOTE_HELPERS = {"logit_lens", "patchscope_lens", "patchscope_generate", "get_token_activations"}
#: The examples whose traces are also run as sent elsewhere: the first use, both engines, nnterp's helpers.
SENT_EXAMPLES = [0, 3, 4]
SEEDED = "import torch\ntorch.manual_seed(0)\n"
#: vLLM's log lines, which it writes to standard output.
VLLM_LOG = re.compile(r"^(\(\S+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d ")


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


def run_example(source: str, path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    path.write_text(source)
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=path.parent, env=env)


def test_readme_names_two_commands_that_the_makefile_has():
    commands = re.findall(r"```bash\n(.*?)```", README, re.S)
    assert [c.strip() for c in commands] == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndemo:" in makefile and "\ntest:" in makefile
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index, tmp_path):
    result = run_example(EXAMPLES[index], tmp_path / f"example_{index}.py")
    assert result.returncode == 0, result.stderr[-3000:]
    for mistake in ("TraceNeverRan", "ParameterWritten"):  # the examples make none of the mistakes caught
        assert mistake not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("index", SENT_EXAMPLES)
def test_readme_example_traces_sent_elsewhere_print_what_they_print_here(index, tmp_path):
    """Sent with ``remote="local"``; an example tracing on vLLM also with its vLLM traces sent to
    ``nnterp-vllm serve --traces`` serving the example's model on loopback."""
    in_process = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    runs = [
        run_example(SEEDED + EXAMPLES[index], tmp_path / "here.py", in_process),
        run_example(SEEDED + sent_as_remote(EXAMPLES[index]), tmp_path / "sent.py", in_process),
    ]
    if "StandardizedVLLM(smollm2()" in EXAMPLES[index]:
        arguments = [str(smollm2()), "--traces", "--dtype", "float32", "--max-model-len", "512"]
        server = Server(arguments, tmp_path / "server.log")
        try:
            server.wait_ready()
            runs.append(run_example(SEEDED + sent_to_server(EXAMPLES[index], server.url), tmp_path / "served.py"))
            assert 'POST /v1/nnsight/generate HTTP/1.1" 200' in server.log.read_text()
            served = runs[-1].stdout + runs[-1].stderr
            assert "init engine" not in served  # no vLLM engine started beside the server: every trace was sent
        finally:
            assert server.stop() == 0
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    printed = [[line for line in run.stdout.splitlines() if not VLLM_LOG.match(line)] for run in runs]
    assert printed[0] and all(lines == printed[0] for lines in printed[1:]), printed
