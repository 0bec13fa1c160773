"""Family coverage: every causal-LM model_type in transformers, served with verified values or refused with a reason.

For each model_type in transformers' causal-LM auto mapping this builds a tiny random
checkpoint (tests/tiny.py), loads it with StandardizedTransformer (its family module, or the
default family), reads ``support()``, and runs the per-family verification
(tests/test_families.py: hidden states, attention pattern, residual identity, head
decomposition, writes, skip, steer) on it. A value counts as served only where support()
claims it and the tests that verify it pass. The same is then done with the default family
serving every type. Then every type is loaded on vLLM's CPU build (its vLLM family, or the
reason it is refused) and tests/test_vllm.py's cross-engine checks run on it against
StandardizedTransformer on the same weights: the vLLM table. The result is COVERAGE.md.

    python tests/family_coverage.py                      # every type; rewrites COVERAGE.md
    python tests/family_coverage.py --types llama,gpt2   # a few types; prints the tables
    python tests/family_coverage.py --vllm-only          # only the vLLM parts of COVERAGE.md, remade
    python tests/family_coverage.py --vllm-survey        # which types vLLM's CPU build runs, family or not
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "COVERAGE.md"
#: Table columns: a value (or an operation) and the tests of tests/test_families.py that verify it.
COLUMNS: dict[str, tuple[str, ...]] = {
    "layer_output": ("test_hidden_states_and_attentions_match_transformers", "test_support_is_honest"),
    "attention_output": ("test_residual_identity",),
    "mlp_output": ("test_residual_identity",),
    "mixer_output": ("test_residual_identity",),
    "mlp.router_logits": ("test_router_logits_match_transformers",),
    "mlp.expert_indices": (
        "test_expert_indices_and_weights_match_a_hook",
        "test_writing_expert_indices_matches_a_hook",
    ),
    "self_attn.attention_probabilities": ("test_hidden_states_and_attentions_match_transformers",),
    "self_attn.attention_queries": (
        "test_queries_keys_values_shapes",
        "test_writing_keys_equal_gives_uniform_causal_pattern",
    ),
    "self_attn.attention_head_outputs": ("test_head_decomposition", "test_writing_values_and_heads"),
    "write": ("test_writing_layer_output_matches_a_hook",),
    "skip": ("test_skip_layers_hands_input_on",),
    "steer": ("test_steer_equals_adding_by_hand",),
}
#: The same columns on vLLM and the tests of tests/test_vllm.py that verify them. The attention pattern and the
#: expert choice, which vLLM's fused kernels never materialize, are rebuilt there and checked against transformers.
VLLM_COLUMNS: dict[str, tuple[str, ...]] = {
    "layer_output": ("test_block_values_equal_transformers", "test_support_claims_only_verified_values"),
    "attention_output": ("test_block_values_equal_transformers", "test_residual_identity_on_vllm"),
    "mlp_output": ("test_block_values_equal_transformers", "test_residual_identity_on_vllm"),
    "mixer_output": ("test_block_values_equal_transformers", "test_residual_identity_on_vllm"),
    "mlp.router_logits": ("test_routing_equals_transformers",),
    "mlp.expert_indices": ("test_routing_equals_transformers",),
    "self_attn.attention_probabilities": (
        "test_pattern_equals_transformers",
        "test_pattern_at_generated_steps_equals_transformers",
    ),
    "self_attn.attention_queries": ("test_attention_interior_equals_transformers",),
    "self_attn.attention_head_outputs": ("test_attention_interior_equals_transformers",),
    "write": ("test_interventions_match_transformers",),
    "skip": ("test_interventions_match_transformers",),
    "steer": ("test_interventions_match_transformers", "test_steered_greedy_generation_matches_transformers"),
}
HEADERS = {
    "layer_output": "layer_output",
    "attention_output": "attention_output",
    "mlp_output": "mlp_output",
    "mixer_output": "mixer_output",
    "mlp.router_logits": "router",
    "mlp.expert_indices": "experts",
    "self_attn.attention_probabilities": "pattern",
    "self_attn.attention_queries": "q/k/v/scores",
    "self_attn.attention_head_outputs": "heads",
    "write": "write",
    "skip": "skip",
    "steer": "steer",
}


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ").replace("|", "/")
    return text if len(text) <= 160 else text[:157] + "..."


def probe(model_type: str, forced_default: bool) -> dict[str, Any]:
    """Build and load one type; its family and support table, or why it could not be built or served."""
    import tiny

    from nnterp_vllm import StandardizedTransformer, UnsupportedFamily
    from nnterp_vllm.families import default
    from nnterp_vllm.families._refused import REFUSED

    if model_type in REFUSED:  # refused with its reason before any checkpoint is read
        return {"status": "refused", "reason": REFUSED[model_type]}
    try:
        path = tiny.checkpoint(model_type)
    except Exception as error:  # noqa: BLE001 - every failure is a row of the table
        return {"status": "not built", "reason": short(error)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = StandardizedTransformer(path, family=default if forced_default else None)
    except UnsupportedFamily as error:
        return {"status": "refused", "reason": short(error)}
    except Exception as error:  # noqa: BLE001
        return {"status": "not loaded", "reason": short(error)}
    family = model.family.__name__.rsplit(".", 1)[-1]
    try:
        table = model.support()
    except Exception as error:  # noqa: BLE001
        return {"status": "not loaded", "family": family, "reason": short(error)}
    support = {k: v for k, v in table.items() if k != "engine"}
    return {"status": "loaded", "family": family, "layers": model.num_layers, "support": support}


def run_tests(
    model_types: list[str], forced_default: bool, test_file: str = "test_families.py", only: tuple[str, ...] = ()
) -> dict[str, dict[str, str]]:
    """``test_file`` (its tests named in ``only``, or all) on ``model_types``:
    ``{type: {test name: passed|failed|skipped}}``."""
    if not model_types:
        return {}
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.xml"
        environment = {**os.environ, "NNTERP_COVERAGE_TYPES": ",".join(model_types)}
        if forced_default:
            environment["NNTERP_COVERAGE_FAMILY"] = "default"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "-p", "no:cacheprovider"]
        command += [str(ROOT / "tests" / test_file), f"--junitxml={report}"]
        command += ["-k", " or ".join(only)] if only else []
        subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)
        outcomes: dict[str, dict[str, str]] = {}
        for case in ElementTree.parse(report).iter("testcase"):
            name = case.get("name", "")
            test, _, parameters = name.partition("[")
            if not parameters:
                continue  # a test of the engine, not of a type
            model_type = owner(parameters.rstrip("]"), model_types)
            outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else "passed"
            if case.find("skipped") is not None:
                outcome = "skipped"
            previous = outcomes.setdefault(model_type, {}).get(test)
            outcomes[model_type][test] = "failed" if "failed" in (previous, outcome) else outcome
    return outcomes


def owner(parameters: str, model_types: list[str]) -> str:
    """The model_type a test id's parameters (``llama``, ``llama-scale``) belong to."""
    padded = f"-{parameters}-"
    matches = [model_type for model_type in model_types if f"-{model_type}-" in padded]
    return max(matches, key=len) if matches else parameters


#: Reasons that say a value does not exist in the architecture (a dense MLP has no router; a recurrent
#: block no attention): not a gap in what the family serves.
NOT_APPLICABLE = ("this family's MLP is dense", "this block's MLP is dense", "this block has no ")


def applicable(reason: str) -> bool:
    return not reason.startswith(NOT_APPLICABLE)


def cell(
    column: str,
    row: dict[str, Any],
    outcomes: dict[str, str],
    reasons: list[str],
    columns: dict[str, tuple[str, ...]] = COLUMNS,
    mark: str = "",
) -> str:
    """✓ verified, ✗ claimed but failing, n/a where the architecture has no such value, or the reason it is
    unavailable (numbered below the table, after ``mark``)."""
    support = row["support"]
    if column not in support and column.partition(".")[1]:
        return "n/a"  # no block has the module (attention on an attention-free model)
    claim = support.get(column)
    if isinstance(claim, dict):
        gaps = {layer: reason for layer, reason in claim.items() if applicable(reason)}
        claim = gaps if gaps or len(claim) < row["layers"] else next(iter(claim.values()))
    if isinstance(claim, str) and not applicable(claim):
        return "n/a"
    if claim:
        reason = claim if isinstance(claim, str) else "; ".join(f"layer {k}: {v}" for k, v in claim.items())
        if reason not in reasons:
            reasons.append(reason)
        return f"— [{mark}{reasons.index(reason) + 1}]"
    results = [outcomes.get(test) for test in columns[column]]
    if "failed" in results or not any(result == "passed" for result in results):
        return "✗"
    return "✓"


def table(
    rows: dict[str, dict[str, Any]],
    outcomes: dict[str, dict[str, str]],
    columns: dict[str, tuple[str, ...]] = COLUMNS,
    mark: str = "",
    engine_gaps: tuple[str, ...] = (),
) -> tuple[list[str], dict[str, int]]:
    """The markdown table and the counts (``gap <column>``: partially served types missing that value); each row
    gets its ``verdict`` (✓, partial, ✗, or its status and reason).

    Reasons are numbered after ``mark`` (``[v3]`` in the vLLM table); a value missing for a reason starting
    with one of ``engine_gaps`` (what the engine never materializes, whatever the family) counts as no gap.
    """
    reasons: list[str] = []
    header = ["model_type", "family", *HEADERS.values()]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    counts = {"walked": len(rows), "every value verified": 0, "partially served": 0, "refused or not built": 0}
    for model_type, row in sorted(rows.items()):
        if row["status"] != "loaded":
            if row["reason"] not in reasons:
                reasons.append(row["reason"])
            note = row["verdict"] = f"{row['status']} [{mark}{reasons.index(row['reason']) + 1}]"
            lines.append(f"| {model_type} | {row.get('family', '—')} | {note} |" + " |" * (len(HEADERS) - 1))
            counts["refused or not built"] += 1
            continue
        cells = [cell(column, row, outcomes.get(model_type, {}), reasons, columns, mark) for column in HEADERS]
        gaps = [
            header
            for header, value in zip(HEADERS.values(), cells)
            if value.startswith("—") and not reasons[int(re.findall(r"\d+", value)[-1]) - 1].startswith(engine_gaps)
        ]
        verified = not gaps and "✗" not in cells
        row["verdict"] = "✓" if verified else "✗" if "✗" in cells else "partial"
        counts["every value verified" if verified else "partially served"] += 1
        for header in gaps:
            counts[f"gap {header}"] = counts.get(f"gap {header}", 0) + 1
        lines.append(f"| {model_type} | {row['family']} | " + " | ".join(cells) + " |")
    lines += ["", "Reasons:", ""] + [f"{mark}{i + 1}. {reason}" for i, reason in enumerate(reasons)]
    return lines, counts


def coverage(
    model_types: list[str], forced_default: bool
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, str]]]:
    rows = {model_type: probe(model_type, forced_default) for model_type in model_types}
    loaded = [model_type for model_type, row in rows.items() if row["status"] == "loaded"]
    return rows, run_tests(loaded, forced_default)


def vllm_probe(model_type: str) -> dict[str, Any]:
    """Load one type on vLLM (its weightless module tree: no engine starts); its vLLM family and support table, or
    why it is refused or could not be loaded."""
    import tiny

    from nnterp_vllm import families
    from nnterp_vllm.checkpoints import read_config
    from nnterp_vllm.engines.vllm import StandardizedVLLM
    from nnterp_vllm.families._refused import REFUSED
    from nnterp_vllm.families._refused_on_vllm import REFUSED as REFUSED_ON_VLLM

    if model_type in REFUSED:
        return {"status": "refused", "reason": REFUSED[model_type]}
    if model_type in REFUSED_ON_VLLM:  # a multimodal wrapper vLLM does not load, whatever its text model
        return {"status": "refused", "reason": REFUSED_ON_VLLM[model_type]}
    try:
        path = tiny.vllm_checkpoint(model_type)
        text_type = families.model_type(read_config(path))
    except Exception as error:  # noqa: BLE001 - every failure is a row of the table
        return {"status": "not built", "reason": short(error)}
    if text_type in REFUSED_ON_VLLM:
        return {"status": "refused", "reason": REFUSED_ON_VLLM[text_type]}
    if text_type not in families.known(families.VLLM):
        return {"status": "no family", "reason": "vLLM's CPU build may run it; no vLLM family module maps it"}
    try:
        model = StandardizedVLLM(path, dtype="float32")
    except Exception as error:  # noqa: BLE001
        return {"status": "not loaded", "reason": short(error)}
    try:
        table = {k: v for k, v in model.support().items() if k != "engine"}
        family = model.family.__name__.rsplit(".", 1)[-1]
        return {"status": "loaded", "family": family, "layers": model.num_layers, "support": table}
    finally:
        model.shutdown()


def vllm_coverage(model_types: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, str]]]:
    """The vLLM rows of ``model_types`` and the outcomes of tests/test_vllm.py on the loaded ones."""
    rows = {model_type: vllm_probe(model_type) for model_type in model_types}
    loaded = [model_type for model_type, row in rows.items() if row["status"] == "loaded"]
    tests = tuple(dict.fromkeys(test for tests in VLLM_COLUMNS.values() for test in tests))
    return rows, run_tests(loaded, False, "test_vllm.py", tests)


def vllm_table(
    rows: dict[str, dict[str, Any]], outcomes: dict[str, dict[str, str]]
) -> tuple[list[str], dict[str, int]]:
    """The vLLM table: a fused MoE's expert choice that no router of vLLM's can rebuild shows its reason but is no
    gap of the family's."""
    from nnterp_vllm.components.vllm import FUSED_MOE

    return table(rows, outcomes, VLLM_COLUMNS, "v", (FUSED_MOE,))


def default_serves_layer_output(rows: dict[str, dict[str, Any]], outcomes: dict[str, dict[str, str]]) -> list[str]:
    """The types on which the default family alone served a verified layer_output."""
    return sorted(
        model_type
        for model_type, row in rows.items()
        if row["status"] == "loaded" and cell("layer_output", row, outcomes.get(model_type, {}), []) == "✓"
    )


def with_vllm_column(lines: list[str], vllm_rows: dict[str, dict[str, Any]]) -> list[str]:
    """The main table's lines with a last column: each type's verdict on vLLM (its row in the vLLM table)."""
    out = []
    for line in lines:
        if line.startswith("| model_type"):
            line += " vLLM |"
        elif line.startswith("|---"):
            line += "---|"
        elif line.startswith("| "):
            line += f" {vllm_rows[line.split('|')[1].strip()]['verdict']} |"
        out.append(line)
    return out


def refusal_groups(rows: dict[str, dict[str, Any]]) -> str:
    """The refused types counted by the kind of reason (what a reason says before its first colon)."""
    groups: dict[str, int] = {}
    for row in rows.values():
        if row["status"] != "loaded":
            kind = row["reason"].split(":", 1)[0] if ":" in row["reason"][:60] else row["reason"][:60]
            groups[kind] = groups.get(kind, 0) + 1
    return "; ".join(f"{kind} {count}" for kind, count in sorted(groups.items(), key=lambda item: -item[1]))


def vllm_summary_line(vllm_counts: dict[str, int]) -> str:
    """The summary's line about vLLM."""
    from nnterp_vllm import families

    return (
        f"- on vLLM (the vLLM column, detailed in the vLLM table below): {len(families.known(families.VLLM))} vLLM "
        f"family modules; {vllm_counts['every value verified']} types with every value verified, "
        f"{vllm_counts['partially served']} partially, {vllm_counts['refused or not built']} refused"
    )


def vllm_section(vllm_rows: dict[str, dict[str, Any]], vllm_lines: list[str], vllm_counts: dict[str, int]) -> list[str]:
    """The document's vLLM section: its heading, summary and table."""
    from nnterp_vllm import families

    return [
        "",
        "## On vLLM",
        "",
        "Each type's tiny checkpoint loaded on vLLM's CPU build with its vLLM family "
        "(`nnterp_vllm/families/vllm/`), and every value it claims checked against StandardizedTransformer on the "
        "same weights by tests/test_vllm.py (✓). The attention pattern and scores, which vLLM's fused attention "
        "kernel never materializes, are rebuilt from the queries and keys it receives with its own rule, and a "
        "fused mixture of experts' choice of experts from the router's logits by its own router: both verified "
        "like any other value (over the prompt; a family whose rule is not rebuilt says why).",
        "",
        f"- vLLM family modules: {len(families.known(families.VLLM))}; types served: "
        f"{vllm_counts['every value verified'] + vllm_counts['partially served']}",
        f"- every value verified: {vllm_counts['every value verified']}",
        f"- partially: {vllm_counts['partially served']}; the values missing, by number of types: "
        + (
            ", ".join(f"{name[4:]} {count}" for name, count in vllm_counts.items() if name.startswith("gap ")) or "none"
        ),
        f"- refused (reason given): {vllm_counts['refused or not built']}; by kind: {refusal_groups(vllm_rows)}",
        "",
        *vllm_lines,
    ]


def document(model_types: list[str]) -> str:
    from nnterp_vllm import families

    known = set(families.known())
    rows, outcomes = coverage(model_types, forced_default=False)
    lines, counts = table(rows, outcomes)
    alone = default_serves_layer_output(*coverage(model_types, forced_default=True))
    without_module = [t for t in model_types if t not in known]
    served = [t for t in alone if t not in known]
    vllm_rows, vllm_outcomes = vllm_coverage(model_types)
    vllm_lines, vllm_counts = vllm_table(vllm_rows, vllm_outcomes)
    summary = [
        "# Family coverage",
        "",
        "Generated by `python tests/family_coverage.py` from transformers' causal-LM auto mapping; "
        "`tests/test_coverage.py` (and, for the vLLM rows of the vLLM families, `tests/test_vllm.py`) fails when "
        "the rows for the family modules stop matching.",
        "",
        f"- model_types walked: {counts['walked']}; family modules: {len(known & set(model_types))}",
        f"- served with every value verified: {counts['every value verified']}",
        f"- served partially (— marks a value unavailable, with its reason): {counts['partially served']}; "
        "the values missing, by number of types: "
        + ", ".join(f"{name[4:]} {count}" for name, count in counts.items() if name.startswith("gap ")),
        f"- refused or not built (reason given): {counts['refused or not built']}",
        f"- the default family alone, on the {len(without_module)} types without a module: verified layer_output "
        f"on {len(served)} ({', '.join(served) or 'none'})",
        f"- the default family alone, on every type walked: verified layer_output on {len(alone)}",
        vllm_summary_line(vllm_counts),
        "",
        "✓ verified against transformers by tests/test_families.py; ✗ claimed but failing; "
        "— unavailable (numbered reason below); n/a: the architecture has no such value (a dense MLP has no "
        "router, a recurrent block no attention). A value served on some blocks and absent from the others "
        "by architecture (a hybrid's attention blocks, a dense first block) is ✓ when verified where it exists.",
        "",
    ]
    section = vllm_section(vllm_rows, vllm_lines, vllm_counts)
    return "\n".join(summary + with_vllm_column(lines, vllm_rows) + section) + "\n"


VLLM_HEADING = "\n## On vLLM\n"


def refreshed_vllm_part(text: str, model_types: list[str]) -> str:
    """``text`` (COVERAGE.md) with its vLLM parts made anew (the summary's vLLM line, the main table's vLLM column,
    the vLLM section), its transformers tables kept: what `document` writes when only vLLM's side changed."""
    vllm_rows, vllm_outcomes = vllm_coverage(model_types)
    vllm_lines, vllm_counts = vllm_table(vllm_rows, vllm_outcomes)
    main = text.partition(VLLM_HEADING)[0]
    lines = []
    for line in main.splitlines():
        if line.startswith("- on vLLM (the vLLM column"):
            line = vllm_summary_line(vllm_counts)
        elif line.startswith("| ") or line.startswith("|---"):
            line = line[: line.rstrip().rstrip("|").rstrip().rfind("|") + 1]  # the vLLM column, cut
        lines.append(line)
    return "\n".join(with_vllm_column(lines, vllm_rows) + vllm_section(vllm_rows, vllm_lines, vllm_counts)) + "\n"


def survey(model_types: list[str]) -> dict[str, dict[str, Any]]:
    """Which types vLLM's CPU build runs without any family: each type's tiny checkpoint loaded with nnsight's
    vLLM alone and traced for one token; the architecture vLLM resolved, or the error it raised.

    A failed build can leave vLLM's process state broken for the next, so each failure ends its process and the
    rest run in a fresh one.
    """
    results: dict[str, dict[str, Any]] = {}
    todo = list(model_types)
    while todo:
        command = [sys.executable, str(Path(__file__).resolve()), "--survey-worker", ",".join(todo)]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        found = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("SURVEY ")]
        for result in found:
            results[result["type"]] = result
        if len(found) < len(todo) and (not found or found[-1]["status"] == "ran"):
            crashed = todo[len(found)]
            results[crashed] = {"type": crashed, "status": "failed", "error": f"the process died: {done.stderr[-300:]}"}
        todo = [model_type for model_type in todo if model_type not in results]
    return results


def survey_worker(model_types: list[str]) -> None:
    """One survey process: print a ``SURVEY {json}`` line per type, and stop at the first failure."""
    import tiny

    from nnterp_vllm.engines.lifecycle import shutdown
    from nnterp_vllm.engines.nnsight_vllm import PlatformVLLM

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for model_type in model_types:
        result: dict[str, Any] = {"type": model_type}
        try:
            model = PlatformVLLM(str(tiny.vllm_checkpoint(model_type)), dtype="float32", dispatch=True)
            try:
                result["architecture"] = f"{type(model._module).__module__}.{type(model._module).__name__}"
                with model.trace(" ", temperature=0.0, max_tokens=1):
                    model.logits.save()
                result["status"] = "ran"
            finally:
                shutdown(model)
        except Exception as error:  # noqa: BLE001 - every failure is a row of the survey
            result.update(status="failed", error=short(error))
        print("SURVEY " + json.dumps(result), flush=True)
        if result["status"] == "failed":
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model_types (default: the whole causal-LM mapping)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of writing COVERAGE.md")
    parser.add_argument(
        "--vllm-survey", action="store_true", help="print which types vLLM's CPU build runs without a family"
    )
    parser.add_argument(
        "--vllm-only",
        action="store_true",
        help="remake only COVERAGE.md's vLLM parts (the transformers tables are kept as they are)",
    )
    parser.add_argument("--survey-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.survey_worker:
        survey_worker(args.survey_worker.split(","))
        return
    model_types = args.types.split(",") if args.types else causal_lm_types()
    if args.vllm_survey:
        for model_type, result in sorted(survey(model_types).items()):
            print(f"{model_type}: {result['status']} {result.get('architecture') or result.get('error')}")
        return
    if args.json:
        rows, outcomes = coverage(model_types, forced_default=False)
        vllm_rows, vllm_outcomes = vllm_coverage(model_types)
        print(json.dumps({"rows": rows, "outcomes": outcomes, "vllm": vllm_rows, "vllm_outcomes": vllm_outcomes}))
        return
    if args.vllm_only:
        OUTPUT.write_text(refreshed_vllm_part(OUTPUT.read_text(), model_types))
        print(f"wrote the vLLM parts of {OUTPUT}")
        return
    text = document(model_types)
    if args.types:
        print(text)
    else:
        OUTPUT.write_text(text)
        print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
