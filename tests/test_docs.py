"""The documentation site builds with nothing broken, and every example on its pages runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from doc_examples import DOCS, ROOT, page_examples, run_example

EXAMPLES = page_examples()
#: The examples that build SmolLM2's steered engine, marked slow: their first run compiles that engine's graph
#: (minutes on 2 cores with nothing cached); `make test-slow` runs them.
COMPILING = "SteeredVLLM(smollm2()"
#: A quoted figure: a ratio (``0.96x``) or a rate (``9.0 traces/s``).
FIGURE = re.compile(r"\b\d+(\.\d+)?x\b|\b\d+(\.\d+)? (traces|tokens)/s\b")
#: A benchmark script named with its command line.
BENCHMARK_COMMAND = re.compile(r"python (benchmarks|tests)/\w+\.py")


def test_the_site_builds_strict_with_every_page_and_reference(tmp_path):
    """``mkdocs build --strict``: a broken link, anchor, include or API reference fails the build."""
    site = tmp_path / "site"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    families = (site / "families" / "index.html").read_text()
    coverage = (ROOT / "COVERAGE.md").read_text().splitlines()
    walked = next(line[2:] for line in coverage if line.startswith("- model_types walked"))
    assert walked in families  # COVERAGE.md included as it is, not a copy that drifts
    models = (site / "reference" / "models" / "index.html").read_text()  # the reference, from the docstrings
    for anchor in (
        "engines.transformers.StandardizedTransformer",
        "engines.vllm.StandardizedVLLM",
        "engines.steered.engine.SteeredVLLM",
        "standardized.Standardized.support",
    ):
        assert f'id="nnterp_vllm.{anchor}"' in models, anchor
    assert "when available, else the reason it is not" in models  # Standardized.support's docstring


def test_the_pages_have_examples_and_the_nav_lists_every_page():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md")]
    assert all(page in nav for page in pages), [page for page in pages if page not in nav]
    guides = {key.split(":")[0] for key in EXAMPLES if key.startswith("guides/")}
    scripted = {"guides/scale.md"}  # its examples are command lines and multi-process runs (tests/test_scale.py)
    assert guides | scripted == {page for page in pages if page.startswith("guides/")}


def test_every_figure_quoted_names_the_benchmark_that_measures_it():
    """A section quoting a ratio or a rate names the script and the command line that measured it."""
    for page in DOCS.rglob("*.md"):
        for section in re.split(r"\n(?=#+ )", page.read_text()):
            prose = re.sub(r"```.*?```", "", section, flags=re.S)
            if FIGURE.search(prose):
                title = section.splitlines()[0]
                assert BENCHMARK_COMMAND.search(prose), f"{page.relative_to(DOCS)}: {title}"


@pytest.mark.parametrize(
    "key",
    [pytest.param(key, marks=[pytest.mark.slow] if COMPILING in EXAMPLES[key] else []) for key in sorted(EXAMPLES)],
)
def test_page_example_runs(key, tmp_path):
    result = run_example(EXAMPLES[key], tmp_path / "example.py")
    assert result.returncode == 0, result.stderr[-3000:]
    for mistake in ("TraceNeverRan", "ParameterWritten"):  # the examples make none of the mistakes caught
        assert mistake not in result.stderr, result.stderr[-3000:]
