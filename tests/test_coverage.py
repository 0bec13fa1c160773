"""COVERAGE.md cannot go stale: its rows for the family modules are what the harness finds now.

The transformers table is checked here; so are the vLLM rows of every type the vLLM engine refuses (no engine
starts for those). The vLLM rows of the vLLM families are checked by tests/test_vllm.py
(`test_coverage_row_is_current`), beside the engine it builds for them anyway.
"""

from __future__ import annotations

import family_coverage as harness

from nnterp_vllm import families

VLLM_SECTION = "## On vLLM"


def rows_of(text: str) -> dict[str, list[str]]:
    """A markdown table's rows by model_type: their cells after the model_type."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| model_type"):
            cells = [cell.strip() for cell in line.split("|")[1:-1]]
            rows[cells[0]] = cells[1:]
    return rows


def checked_in() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """COVERAGE.md's rows: (the transformers table's, the vLLM table's)."""
    text = harness.OUTPUT.read_text()
    main, _, on_vllm = text.partition(VLLM_SECTION)
    return rows_of(main), rows_of(on_vllm)


def reasons_of(text: str, mark: str = "v") -> dict[str, str]:
    """The numbered reasons under a table, by their reference (``v3``)."""
    found = {}
    for line in text.splitlines():
        number, dot, reason = line.partition(". ")
        if dot and number.startswith(mark) and number[len(mark) :].isdigit():
            found[number] = reason
    return found


def marks(cells: list[str]) -> list[str]:
    """The cells without their reasons' numbers (which shift as reasons come and go)."""
    return [cell.split("[")[0].strip() for cell in cells]


def test_coverage_rows_of_family_modules_match_the_harness():
    checked_in_rows, _ = checked_in()
    model_types = sorted(set(families.known()) & set(harness.causal_lm_types()))
    rows, outcomes = harness.coverage(model_types, forced_default=False)
    found = rows_of("\n".join(harness.table(rows, outcomes)[0]))
    for model_type in model_types:
        assert model_type in checked_in_rows, f"{model_type} has a family module but no row in COVERAGE.md"
        ours, theirs = found[model_type], checked_in_rows[model_type][: len(found[model_type])]
        assert marks(ours) == marks(theirs), (
            f"COVERAGE.md's row for {model_type} is stale: the harness finds {ours!r}; "
            "regenerate it with `python tests/family_coverage.py`"
        )
        assert "✗" not in marks(ours), f"{model_type}: a value its family claims fails verification: {ours}"


def test_vllm_rows_of_refused_types_match_the_harness():
    """Every type COVERAGE.md shows refused on vLLM is refused now for the same kind of reason, and every type with a
    vLLM family has a vLLM row."""
    _, checked_in_rows = checked_in()
    checked_in_reasons = reasons_of(harness.OUTPUT.read_text().partition(VLLM_SECTION)[2])
    for model_type in families.known(families.VLLM):
        if model_type in harness.causal_lm_types():
            assert checked_in_rows.get(model_type, [""])[0] != "—", f"{model_type} has a vLLM family but no vLLM row"
    refused = {model_type for model_type, cells in checked_in_rows.items() if cells[0] == "—"}
    rows = {model_type: harness.vllm_probe(model_type) for model_type in sorted(refused)}
    found = rows_of("\n".join(harness.vllm_table(rows, {})[0]))
    for model_type in sorted(refused):
        reference = checked_in_rows[model_type][1].split("[")[-1].rstrip("]")
        assert marks(found[model_type]) == marks(checked_in_rows[model_type]), (
            f"COVERAGE.md's vLLM row for {model_type} is stale: the harness finds {found[model_type]!r}; "
            "regenerate it with `python tests/family_coverage.py`"
        )
        assert checked_in_reasons.get(reference) == rows[model_type]["reason"], (
            f"COVERAGE.md gives another reason for refusing {model_type} on vLLM than the harness finds now: "
            f"{rows[model_type]['reason']!r}; regenerate it with `python tests/family_coverage.py`"
        )
