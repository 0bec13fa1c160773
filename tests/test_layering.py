"""The package's rooms import each other one way: every import counted, at module level, inside functions and under
``TYPE_CHECKING``; and no module grows past what one reader holds in mind.

A room is a top-level module of ``nnterp_vllm`` or one of its packages (a subpackage is a room of its own:
``families.vllm``, ``engines.steered``). The source is read, not imported, so an import anywhere counts.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nnterp_vllm"
BENCHMARKS = PACKAGE.parent / "benchmarks"
#: The most lines a module of the package or of the benchmarks may have.
MOST_LINES = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
PACKAGES = {module_name(path) for path in PACKAGE.rglob("__init__.py")}


def room(module: str) -> str:
    """The room ``module`` lies in: its package, or itself where it is a top-level module or a package."""
    if module in PACKAGES:
        return module
    parent = module.rpartition(".")[0]
    return module if parent == PACKAGE.name else parent


def imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package's modules ``node`` (an import in ``module``) imports: a name that is a submodule counts as it."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module if module in PACKAGES else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                anchor = anchor.rpartition(".")[0]
            base = f"{anchor}.{node.module}" if node.module else anchor
        targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    found = []
    for target in targets:
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target:
            found.append(target)
    return found


def module_imports(module: str, source: str) -> list[tuple[str, int]]:
    """The package's modules that ``source`` (the text of ``module``) imports anywhere in it, with the line."""
    return [
        (target, node.lineno)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for target in imported(module, node)
    ]


def room_imports() -> dict[tuple[str, str], list[str]]:
    """(room, room it imports) -> the imports that make the edge, as ``module:line -> module``."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, path in MODULES.items():
        for target, line in module_imports(module, path.read_text()):
            if room(module) != room(target):
                edges[room(module), room(target)].append(f"{module}:{line} -> {target}")
    return edges


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one room (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in edges:
        graph[source].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for after in graph[node]:
            if after not in index:
                visit(after)
                low[node] = min(low[node], low[after])
            elif after in stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_walk_sees_every_kind_of_import():
    source = """
from typing import TYPE_CHECKING
from . import arguments
if TYPE_CHECKING:
    from .specs.saes import SAE
def load():
    from .engines.steered import engine
    import nnterp_vllm.harvest.run
"""
    found = module_imports("nnterp_vllm.standardized", source)
    assert found == [
        ("nnterp_vllm.arguments", 3),
        ("nnterp_vllm.specs.saes", 5),
        ("nnterp_vllm.engines.steered.engine", 7),
        ("nnterp_vllm.harvest.run", 8),
    ]
    assert room("nnterp_vllm.engines.steered.engine") == "nnterp_vllm.engines.steered"
    assert room("nnterp_vllm.specs") == "nnterp_vllm.specs"
    assert room("nnterp_vllm.standardized") == "nnterp_vllm.standardized"


def test_no_two_rooms_import_each_other_by_any_path():
    edges = room_imports()
    found = cycles(edges)
    described = [
        "\n".join(
            f"  {source} -> {target}: {edges[source, target][0]}"
            for source, target in edges
            if {source, target} <= set(group)
        )
        for group in found
    ]
    assert not found, "rooms importing each other:\n" + "\n".join(described)


def test_the_walk_finds_a_cycle_where_there_is_one():
    edges = {("a", "b"): ["a:1 -> b"], ("b", "c"): ["b:1 -> c"], ("c", "a"): ["c:1 -> a"], ("c", "d"): ["c:2 -> d"]}
    assert cycles(edges) == [["a", "b", "c"]]


def test_no_module_is_longer_than_a_reader_holds():
    long = {
        str(path.relative_to(PACKAGE.parent)): count
        for path in [*PACKAGE.rglob("*.py"), *BENCHMARKS.rglob("*.py")]
        if (count := len(path.read_text().splitlines())) > MOST_LINES
    }
    assert not long, f"modules over {MOST_LINES} lines (split them by meaning): {long}"
