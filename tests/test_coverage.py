"""COVERAGE.md cannot go stale: its rows for the family modules are what the harness finds now."""

from __future__ import annotations

import family_coverage as harness

from nnterp_vllm import families


def rows_of(text: str) -> dict[str, str]:
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| model_type"):
            rows[line.split("|")[1].strip()] = line
    return rows


def test_coverage_rows_of_family_modules_match_the_harness():
    checked_in = rows_of(harness.OUTPUT.read_text())
    model_types = sorted(set(families.known()) & set(harness.causal_lm_types()))
    rows, outcomes = harness.coverage(model_types, forced_default=False)
    found = rows_of("\n".join(harness.table(rows, outcomes)[0]))
    for model_type in model_types:
        assert model_type in checked_in, f"{model_type} has a family module but no row in COVERAGE.md"
        ours, theirs = found[model_type].split("|")[2:], checked_in[model_type].split("|")[2:]
        marks = [cell.split("[")[0].strip() for cell in ours]
        assert marks == [cell.split("[")[0].strip() for cell in theirs], (
            f"COVERAGE.md's row for {model_type} is stale: the harness finds {found[model_type]!r}; "
            "regenerate it with `python tests/family_coverage.py`"
        )
        assert "✗" not in marks, f"{model_type}: a value its family claims fails verification: {found[model_type]}"
