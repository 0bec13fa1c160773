"""README.md's commands and examples are true."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_names_two_commands_that_the_makefile_has():
    commands = re.findall(r"```bash\n(.*?)```", README, re.S)
    assert [c.strip() for c in commands] == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndemo:" in makefile and "\ntest:" in makefile
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index, tmp_path):
    script = tmp_path / f"example_{index}.py"
    script.write_text(EXAMPLES[index])
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for mistake in ("TraceNeverRan", "ParameterWritten"):  # the examples make none of the mistakes caught
        assert mistake not in result.stderr, result.stderr[-3000:]
