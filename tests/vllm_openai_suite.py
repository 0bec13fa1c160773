"""vLLM's own OpenAI API tests against ``vllm serve`` and against ``nnterp-vllm serve``, side by side.

    python tests/vllm_openai_suite.py VLLM_SOURCE [--only vllm|nnterp] [-k EXPR] [--out DIR]
        [--test-limit S] [--file-limit S]

``VLLM_SOURCE`` is vLLM 0.32.0's source tree (``git clone --depth 1 --branch v0.32.0
https://github.com/vllm-project/vllm``, or the unpacked sdist from PyPI, tests included); its
``tests/entrypoints/openai`` run here, unchanged, file by file, each file first with vLLM's own server then
with ours, through a ``vllm`` first on ``PATH`` for their ``RemoteOpenAIServer``'s ``vllm serve``: once it starts
vLLM's own server (through vLLM's API-server entry point: vLLM's command line stops with SIGILL on this machine
as it imports all its subcommands), once ``nnterp-vllm serve``. A run stopped early has compared whole files.
Every hub model name a test uses resolves to the embedded model (SmolLM2-135M, `checkpoints.smollm2`):
the tests run in a directory where each ``org/name`` is a link to its checkpoint. Tests of LoRA, GPUs,
multimodal models and gpt-oss's harmony format are left out (`LEFT_OUT`). A test running longer than
``--test-limit`` (120 s) fails on either server alike. Reports and logs go to ``--out``, one per file and
server; a rerun runs only the files without a report there. The script prints, per server, how many tests
passed, failed, errored and were skipped, and every test that passes on vLLM's server but not on ours.
Whole run: about two hours on a 2-core CPU machine (each test module starts its servers).
Needs pytest-asyncio, pytest-timeout and tblib, which it installs beside (not into) the environment, under
``.cache/``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
DEPENDENCIES = ROOT / ".cache" / "vllm-openai-suite"
#: What vLLM's test suite imports that this project's environment lacks, installed beside it.
TEST_DEPENDENCIES = ("pytest-asyncio==1.5.0", "tblib==3.2.2", "pytest-timeout==2.4.0")
#: Test files of vLLM's OpenAI suite left out: LoRA, tensorizer, lm-eval correctness on GPUs, gpt-oss's
#: harmony format (a 20B model whose tokenizer the embedded model cannot stand in for); the suite of this vLLM
#: version has no multimodal test file under tests/entrypoints/openai. test_openai_schema fuzzes the API with
#: schemathesis, a large dependency this environment does not carry.
LEFT_OUT = ("lora", "tensorizer", "correctness", "harmony", "mcp_tools", "openai_schema")
SERVERS = ("vllm", "nnterp")
#: Shared memory a server killed by a test leaves (vLLM's queues, Python's multiprocessing): removed after each file.
SHARED_MEMORY_LEFT = ("psm_*", "vllm_*", "sem.mp-*", "sem.loky-*")
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


def suite_files(source: Path) -> list[Path]:
    """vLLM's OpenAI test files this suite runs."""
    files = sorted((source / "tests" / "entrypoints" / "openai").rglob("test_*.py"))
    return [path for path in files if not any(word in str(path.relative_to(source)) for word in LEFT_OUT)]


def hub_names(files: list[Path]) -> set[str]:
    """Every quoted ``org/name`` in the test files (hub model names, and a few other strings: harmless)."""
    return {name for path in files for name in HUB_NAME.findall(path.read_text()) if not name.startswith("v1")}


def prepare(source: Path, files: list[Path], workdir: Path) -> None:
    """A working directory where vLLM's tests import and every hub name they use is the embedded model."""
    from nnterp_vllm.checkpoints import smollm2

    checkpoint = smollm2()
    tests = workdir / "tests"  # vLLM's tests package, without its source tree (which would shadow the installed vllm)
    if not tests.exists():
        tests.symlink_to(source / "tests", target_is_directory=True)
    examples = workdir / "examples"  # chat templates the tests name by their path in the source tree
    if not examples.exists():
        examples.symlink_to(source / "examples", target_is_directory=True)
    for name in hub_names(files):
        link = workdir / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(checkpoint, target_is_directory=True)
    venv = Path(sys.executable).parent
    for server in SERVERS:
        binaries = workdir / f"bin-{server}"
        binaries.mkdir(exist_ok=True)
        shim = binaries / "vllm"
        nnterp = str(venv / "nnterp-vllm")
        shim.write_text(SHIM.format(python=sys.executable, steered=server == "nnterp", nnterp=nnterp))
        shim.chmod(0o755)


def shared_memory() -> set[Path]:
    """The files in /dev/shm named as `SHARED_MEMORY_LEFT` says."""
    return {path for pattern in SHARED_MEMORY_LEFT for path in Path("/dev/shm").glob(pattern)}


def run(source: Path, path: Path, server: str, workdir: Path, options: argparse.Namespace) -> Path:
    """pytest over one test file with ``server``'s ``vllm serve``; the JUnit report's path.

    A test still running after ``options.test_limit`` seconds fails; a file still running after
    ``options.file_limit`` is stopped with everything it started (its report is then missing, and its tests
    count as not run). A file whose report ``options.out`` already holds is not run again."""
    relative = path.relative_to(source)
    report = options.out / server / relative.with_suffix(".xml")
    if report.exists():
        return report
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(workdir / f"bin-{server}"), str(Path(sys.executable).parent), os.environ["PATH"]]),
        "PYTHONPATH": os.pathsep.join([str(DEPENDENCIES), str(workdir), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_RPC_BASE_PATH": str(workdir),
        # tests that ask for more context than the embedded model's 8,192 tokens (and use far less)
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
        "TMPDIR": str(workdir),  # vLLM's own server leaves its rendezvous file in the temporary directory
    }
    report.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pytest", "-p", "pytest_asyncio", "-p", "no:cacheprovider", "-q", "-rN"]
    command += ["--rootdir", str(workdir), f"--junitxml={report}", "-o", "asyncio_mode=auto"]
    command += [f"--timeout={options.test_limit:.0f}", "-o", "timeout_func_only=true"]  # pytest-timeout
    command += [*(["-k", options.keyword] if options.keyword else []), str(workdir / relative)]
    shared_before = shared_memory()
    with open(report.with_suffix(".log"), "w") as log:
        process = subprocess.Popen(
            command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            process.wait(timeout=options.file_limit)
        except subprocess.TimeoutExpired:
            # the servers a test starts run in sessions of their own: stop them with the pytest that started them
            for started in [*psutil.Process(process.pid).children(recursive=True), psutil.Process(process.pid)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    started.kill()
            process.wait()
            report.unlink(missing_ok=True)
            log.write(f"\nstopped after {options.file_limit:.0f} s\n")
    for leftover in shared_memory() - shared_before:
        leftover.unlink(missing_ok=True)
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
    parser.add_argument("--only", choices=SERVERS, help="run against one server")
    parser.add_argument("-k", dest="keyword", help="pytest's -k, to run part of the suite")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "vllm-openai-suite", help="reports and logs (a rerun keeps the reports here)"
    )
    parser.add_argument("--test-limit", type=float, default=120, help="seconds one test may run (then it fails)")
    parser.add_argument("--file-limit", type=float, default=1800, help="seconds one test file may run on one server")
    args = parser.parse_args(argv)
    if not all((DEPENDENCIES / name).exists() for name in ("pytest_asyncio", "tblib", "pytest_timeout.py")):
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(DEPENDENCIES)]
        subprocess.run([*pip, *TEST_DEPENDENCIES], check=True)
    source = args.source.resolve()
    files = suite_files(source)
    args.out.mkdir(parents=True, exist_ok=True)
    servers = [args.only] if args.only else list(SERVERS)
    results: dict[str, dict[str, str]] = {server: {} for server in servers}
    with tempfile.TemporaryDirectory(prefix="vllm-openai-suite-") as workdir:
        prepare(source, files, Path(workdir))
        for path in files:  # file by file, each server in turn: a run stopped early still compares like with like
            ran = []
            for server in servers:
                report = run(source, path, server, Path(workdir), args)
                found = outcomes(report) if report.exists() else {}
                results[server].update(found)
                ran.append(f"{server}: {len(found)} tests" if report.exists() else f"{server}: no report (see its log)")
            print(path.relative_to(source), *ran, sep="  ", flush=True)
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
