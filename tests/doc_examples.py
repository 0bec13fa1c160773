"""The documentation's examples: the ```python blocks of README.md and of the site's pages under docs/.

Each block is a whole script; the suite runs each once, as it is, in a subprocess (`run_example`). A README example
that is also a page's (the README's short examples are taken from the guides) runs once, with the page's.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
#: A fenced Python block: the suite runs every one of them (those building SmolLM2's steered engine under `slow`).
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def python_blocks(text: str) -> list[str]:
    """The sources of ``text``'s ```python blocks, in order."""
    return PYTHON_BLOCK.findall(text)


def page_examples() -> dict[str, str]:
    """Every ```python block of the site's pages, keyed ``"<page>:<index>"`` (the page relative to docs/)."""
    examples = {}
    for page in sorted(DOCS.rglob("*.md")):
        for index, source in enumerate(python_blocks(page.read_text())):
            examples[f"{page.relative_to(DOCS)}:{index}"] = source
    return examples


def readme_examples() -> list[str]:
    """README.md's ```python blocks, in order."""
    return python_blocks(README.read_text())


def run_example(source: str, path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``source`` as the script ``path`` (written there), in ``path``'s directory, capturing its output."""
    path.write_text(source)
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=path.parent, env=env)
