"""README.md's commands and examples are true."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def sent_as_remote(source: str) -> str:
    """``source`` with every trace and generation it opens, and every nnterp helper it calls, given
    ``remote="local"``: serialized and rebuilt as a server with this library installed would, then run here."""
    tree = ast.parse(source)
    calls = [item.context_expr for node in ast.walk(tree) if isinstance(node, ast.With) for item in node.items]
    calls = [call for call in calls if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)]
    calls = [call for call in calls if call.func.attr in ("trace", "generate")]
    calls += [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in REMOTE_HELPERS
    ]
    assert calls, "the example sends nothing"
    for call in calls:
        call.keywords.append(ast.keyword("remote", ast.Constant("local")))
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
def test_readme_example_traces_sent_remotely_print_what_they_print_here(index, tmp_path):
    in_process = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    here = run_example(SEEDED + EXAMPLES[index], tmp_path / "here.py", in_process)
    sent = run_example(SEEDED + sent_as_remote(EXAMPLES[index]), tmp_path / "sent.py", in_process)
    assert here.returncode == 0, here.stderr[-3000:]
    assert sent.returncode == 0, sent.stderr[-3000:]
    printed = [[line for line in run.stdout.splitlines() if not VLLM_LOG.match(line)] for run in (here, sent)]
    assert printed[1] == printed[0] and printed[0]
