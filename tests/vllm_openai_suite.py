"""vLLM's own OpenAI API tests against ``vllm serve`` and against ``nnterp-vllm serve``, side by side.

    python tests/vllm_openai_suite.py VLLM_SOURCE [--only vllm|nnterp] [-k EXPR] [--out DIR]

``VLLM_SOURCE`` is vLLM 0.32.0's source tree (``git clone --depth 1 --branch v0.32.0
https://github.com/vllm-project/vllm``, or the unpacked sdist); its ``tests/entrypoints/openai`` run
here, unchanged, twice, with a ``vllm`` first on ``PATH`` for their ``RemoteOpenAIServer``'s ``vllm serve``: once
it starts vLLM's own server (through vLLM's API-server entry point: vLLM's command line stops with SIGILL
on this machine as it imports all its subcommands), once ``nnterp-vllm serve``.
Every hub model name a test uses resolves to the embedded model (SmolLM2-135M, `checkpoints.smollm2`):
the tests run in a directory where each ``org/name`` is a link to its checkpoint. Tests of LoRA, GPUs,
multimodal models and gpt-oss's harmony format are left out (`LEFT_OUT`). The script prints, per server,
how many tests passed, failed, errored and were skipped, and every test that passes on vLLM's server but
not on ours. Whole run: about 1 h 45 min on a 2-core CPU machine (each test module starts its servers).
Needs pytest-asyncio and tblib, which it installs beside (not into) the environment, under ``.cache/``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEPENDENCIES = ROOT / ".cache" / "vllm-openai-suite"
#: What vLLM's test suite imports that this project's environment lacks, installed beside it.
TEST_DEPENDENCIES = ("pytest-asyncio==1.5.0", "tblib==3.2.2")
#: Test files of vLLM's OpenAI suite left out: LoRA, tensorizer, lm-eval correctness on GPUs, gpt-oss's
#: harmony format (a 20B model whose tokenizer the embedded model cannot stand in for); the suite of this vLLM
#: version has no multimodal test file under tests/entrypoints/openai. test_openai_schema fuzzes the API with
#: schemathesis, a large dependency this environment does not carry.
LEFT_OUT = ("lora", "tensorizer", "correctness", "harmony", "mcp_tools", "openai_schema")
HUB_NAME = re.compile(r"""["']([A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9])["']""")
SHIM = """#!{python}
import os, sys
if __name__ == "__main__":  # vLLM's engine processes are spawned: they import this file again
    if sys.argv[1:2] != ["serve"]:
        sys.exit("this vllm runs `vllm serve` only")
    if {steered}:
        os.execv({nnterp!r}, [{nnterp!r}, "serve", *sys.argv[2:]])
    # vLLM's own server, through its API server's entry point: vLLM's command line (which imports every
    # subcommand) stops with SIGILL on some CPUs, and asks for the version of a distribution named "vllm".
    args = sys.argv[2:]
    if args and not args[0].startswith("-"):
        args = ["--model", args[0], *args[1:]]
    sys.argv = [sys.argv[0], *args]
    from vllm.entrypoints.launchers.api_server.entry import main
    main()
"""


def test_files(source: Path) -> list[Path]:
    """vLLM's OpenAI test files this suite runs."""
    files = sorted((source / "tests" / "entrypoints" / "openai").rglob("test_*.py"))
    return [path for path in files if not any(word in str(path.relative_to(source)) for word in LEFT_OUT)]


def hub_names(files: list[Path]) -> set[str]:
    """Every quoted ``org/name`` in the test files (hub model names, and a few other strings: harmless)."""
    return {name for path in files for name in HUB_NAME.findall(path.read_text()) if not name.startswith("v1")}


def run(source: Path, files: list[Path], server: str, workdir: Path, out: Path, keyword: str | None) -> Path:
    """pytest over ``files`` with ``server``'s ``vllm serve``; the JUnit report's path."""
    from nnterp_vllm.checkpoints import smollm2

    checkpoint = smollm2()
    tests = workdir / "tests"  # vLLM's tests package, without its source tree (which would shadow the installed vllm)
    if not tests.exists():
        tests.symlink_to(source / "tests", target_is_directory=True)
    for name in hub_names(files):
        link = workdir / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(checkpoint, target_is_directory=True)
    binaries = workdir / f"bin-{server}"
    binaries.mkdir(exist_ok=True)
    venv = Path(sys.executable).parent
    shim = binaries / "vllm"
    shim.write_text(SHIM.format(python=sys.executable, steered=server == "nnterp", nnterp=str(venv / "nnterp-vllm")))
    shim.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{binaries}{os.pathsep}{venv}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join([str(DEPENDENCIES), str(workdir), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_RPC_BASE_PATH": str(workdir),
    }
    report = out / f"{server}.xml"
    command = [sys.executable, "-m", "pytest", "-p", "pytest_asyncio", "-p", "no:cacheprovider", "-q", "-rN"]
    command += ["--rootdir", str(workdir), f"--junitxml={report}", "-o", "asyncio_mode=auto"]
    command += ["--continue-on-collection-errors"]  # a module whose GPU marks fail on CPU is counted an error
    command += [*(["-k", keyword] if keyword else []), *(str(workdir / path.relative_to(source)) for path in files)]
    with open(out / f"{server}.log", "w") as log:
        subprocess.run(command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    return report


def outcomes(report: Path) -> dict[str, str]:
    """Each test of a JUnit report and how it ended: passed, failed, error or skipped."""
    found = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        found[name] = {"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="vLLM 0.32.0's source tree (with its tests/)")
    parser.add_argument("--only", choices=["vllm", "nnterp"], help="run against one server")
    parser.add_argument("-k", dest="keyword", help="pytest's -k, to run part of the suite")
    parser.add_argument("--out", type=Path, default=ROOT / "vllm-openai-suite", help="reports and logs")
    args = parser.parse_args(argv)
    if not all((DEPENDENCIES / name).exists() for name in ("pytest_asyncio", "tblib")):
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(DEPENDENCIES)]
        subprocess.run([*pip, *TEST_DEPENDENCIES], check=True)
    files = test_files(args.source.resolve())
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="vllm-openai-suite-") as workdir:
        for server in [args.only] if args.only else ["vllm", "nnterp"]:
            report = run(args.source.resolve(), files, server, Path(workdir), args.out, args.keyword)
            results[server] = outcomes(report) if report.exists() else {}
    for server, found in results.items():
        counts = {
            kind: sum(1 for outcome in found.values() if outcome == kind)
            for kind in ("passed", "failed", "error", "skipped")
        }
        print(f"{server}: {len(found)} tests, " + ", ".join(f"{count} {kind}" for kind, count in counts.items()))
    if len(results) == 2:
        only_vllm = sorted(
            test
            for test, outcome in results["vllm"].items()
            if outcome == "passed" and results["nnterp"].get(test) != "passed"
        )
        print(f"passed on vLLM's server, not on nnterp-vllm serve: {len(only_vllm)}")
        for test in only_vllm:
            print(f"  {test}: {results['nnterp'].get(test, 'not run')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
