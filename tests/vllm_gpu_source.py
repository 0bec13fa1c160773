"""vLLM's Python source as its GPU build ships it, fetched once from PyPI and read statically.

`gpu_source` downloads the GPU wheel of the pinned vLLM (``vllm==X``: about 330 MB, CUDA-only, never
installed) and keeps only its ``vllm/**/*.py`` files (about 2,900 files, 45 MB), its ``METADATA`` and its file
name (``WHEEL_FILE``) under this project's out-of-tree cache (`nnterp_vllm.checkpoints.cache_dir`:
``$NNTERP_VLLM_CACHE``, else ``~/.cache/nnterp_vllm``), where a fresh checkout finds them again; the download is
too large for the in-tree ``.cache/`` the other test fixtures use. vLLM's sdist (45 MB) is not used: ``pip
download`` prepares an sdist's metadata by running its build backend with its build requirements (torch among
them), which is no plain download and fails without them.

`SourceTree` answers what a module, class or member is in one copy of vLLM's source (the GPU build's here, or
the installed CPU build's) from the files' syntax trees alone: neither copy is imported.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from nnterp_vllm.checkpoints import cache_dir

POSITIONAL_ONLY = inspect.Parameter.POSITIONAL_ONLY
POSITIONAL_OR_KEYWORD = inspect.Parameter.POSITIONAL_OR_KEYWORD
VAR_POSITIONAL = inspect.Parameter.VAR_POSITIONAL
KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY
VAR_KEYWORD = inspect.Parameter.VAR_KEYWORD

#: The wheel pip picks for the GPU build: vLLM's CUDA wheels are ``cp38-abi3``, so one serves every Python.
WHEEL_PLATFORM = ("--python-version", "3.12", "--platform", "manylinux_2_28_x86_64")
#: The fetch stops after this long (a slow mirror); the tests that need the source then skip.
FETCH_TIMEOUT = 1800


#: Syntax trees by source text, and class members by class node: the two copies of vLLM share most files, which
#: are read once.
PARSED: dict[str, ast.Module] = {}
MEMBERS: dict[ast.ClassDef, dict[str, Any]] = {}
#: What `SourceTree.members` gives a name a class body only annotates.
DECLARED = "declared"


class FetchError(RuntimeError):
    """pip could not download the GPU wheel (no network, no such version)."""


def gpu_source(version: str) -> Path:
    """The directory holding ``vllm/`` (Python files only) and ``METADATA`` of vLLM ``version``'s GPU wheel.

    Downloaded on first use into a temporary directory beside the cache entry and renamed into place when
    complete, so an interrupted run leaves no partial tree; the wheel itself is not kept. Raises `FetchError`
    when pip fails.
    """
    target = cache_dir() / f"vllm-{version}-gpu-source"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as temporary:
        wheels = Path(temporary) / "wheel"
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", *WHEEL_PLATFORM]
        command += ["--disable-pip-version-check", "--no-cache-dir", "--dest", str(wheels), f"vllm=={version}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=FETCH_TIMEOUT)
        except subprocess.TimeoutExpired as error:
            raise FetchError(f"`{' '.join(command)}` ran past {FETCH_TIMEOUT} s") from error
        found = sorted(wheels.glob("vllm-*.whl"))
        if done.returncode != 0 or not found:
            raise FetchError(f"`{' '.join(command)}` failed:\n{(done.stdout + done.stderr)[-2000:]}")
        tree = Path(temporary) / "tree"
        tree.mkdir()
        with zipfile.ZipFile(found[0]) as wheel:
            for name in wheel.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    wheel.extract(name, tree)
                elif name.endswith(".dist-info/METADATA"):
                    (tree / "METADATA").write_bytes(wheel.read(name))
        (tree / "WHEEL_FILE").write_text(found[0].name + "\n")
        try:
            tree.rename(target)
        except OSError:
            if not target.is_dir():  # another run renamed its complete copy first: keep that one
                raise
    return target


def python_files(root: Path) -> dict[str, str]:
    """``{path under root: sha256}`` of every ``vllm/**/*.py`` file below ``root``."""
    return {
        path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in (root / "vllm").rglob("*.py")
    }


class Imported(NamedTuple):
    """A name an import statement binds: module ``module`` itself (``name`` None), or its attribute ``name``."""

    module: str
    name: str | None


class Parameter(NamedTuple):
    """One parameter of a def as a call depends on it: name, kind, and whether it has a default."""

    name: str
    kind: inspect._ParameterKind
    default: bool

    @classmethod
    def of(cls, signature: inspect.Signature) -> tuple[Parameter, ...]:
        """The parameters of a live function's signature."""
        return tuple(cls(p.name, p.kind, p.default is not p.empty) for p in signature.parameters.values())


class Step(NamedTuple):
    """What one dotted step is in a copy of vLLM: ``kind`` (module, class, def, attribute, builtin, external,
    missing), the qualified ``name``, a def's `Parameter` tuple, and its ``file``."""

    kind: str
    name: str
    parameters: tuple[Parameter, ...]
    file: str

    def __str__(self) -> str:
        text = f"{self.kind} {self.name}" + (f"({render(self.parameters)})" if self.kind == "def" else "")
        return f"{text} [{self.file}]" if self.file else text


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[Parameter, ...]:
    """A def's parameters (annotations and the defaults' values left out)."""
    arguments = function.args
    positional = [*arguments.posonlyargs, *arguments.args]
    first_default = len(positional) - len(arguments.defaults)
    found = [
        Parameter(
            argument.arg,
            POSITIONAL_ONLY if index < len(arguments.posonlyargs) else POSITIONAL_OR_KEYWORD,
            index >= first_default,
        )
        for index, argument in enumerate(positional)
    ]
    if arguments.vararg:
        found.append(Parameter(arguments.vararg.arg, VAR_POSITIONAL, False))
    for argument, default in zip(arguments.kwonlyargs, arguments.kw_defaults):
        found.append(Parameter(argument.arg, KEYWORD_ONLY, default is not None))
    if arguments.kwarg:
        found.append(Parameter(arguments.kwarg.arg, VAR_KEYWORD, False))
    return tuple(found)


def render(found: Sequence[Parameter]) -> str:
    """Parameters as a def spells them: ``self, a, /, b=…, *args, c, **kwargs`` (``=…``: has a default)."""
    parts = []
    for index, parameter in enumerate(found):
        following = found[index + 1].kind if index + 1 < len(found) else None
        if parameter.kind == KEYWORD_ONLY and (index == 0 or found[index - 1].kind < VAR_POSITIONAL):
            parts.append("*")
        prefix = {VAR_POSITIONAL: "*", VAR_KEYWORD: "**"}.get(parameter.kind, "")
        parts.append(prefix + parameter.name + ("=…" if parameter.default else ""))
        if parameter.kind == POSITIONAL_ONLY and following != POSITIONAL_ONLY:
            parts.append("/")
    return ", ".join(parts)


def accepts(override: Sequence[Parameter], base: Sequence[Parameter]) -> bool:
    """Whether a def with the parameters ``override`` takes every call that one with ``base`` takes (what an
    override over ``base`` needs, whoever calls it)."""
    kinds = {parameter.kind for parameter in override}
    positional = [parameter for parameter in override if parameter.kind <= POSITIONAL_OR_KEYWORD]
    by_keyword = {parameter.name for parameter in override if parameter.kind in (POSITIONAL_OR_KEYWORD, KEYWORD_ONLY)}
    for index, parameter in enumerate(p for p in base if p.kind <= POSITIONAL_OR_KEYWORD):
        if index >= len(positional) and VAR_POSITIONAL not in kinds:
            return False
        if (
            parameter.kind == POSITIONAL_OR_KEYWORD
            and VAR_KEYWORD not in kinds
            and (
                parameter.name not in by_keyword
                or (index < len(positional) and positional[index].name != parameter.name)
            )
        ):
            return False
    for parameter in base:
        if parameter.kind == KEYWORD_ONLY and parameter.name not in by_keyword and VAR_KEYWORD not in kinds:
            return False
        if parameter.kind in (VAR_POSITIONAL, VAR_KEYWORD) and parameter.kind not in kinds:
            return False
    required = {p.name for p in override if not p.default and p.kind not in (VAR_POSITIONAL, VAR_KEYWORD)}
    return required <= {parameter.name for parameter in base}


def top_level(statements: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a module or class body, including those nested in ``if``/``try``/``with``/loops (which
    still bind names at that level), not those inside functions or classes."""
    for statement in statements:
        yield statement
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for field in ("body", "orelse", "finalbody"):
            yield from top_level(getattr(statement, field, None) or [])
        for handler in getattr(statement, "handlers", None) or []:
            yield from top_level(handler.body)


def assigned_names(statement: ast.stmt) -> list[str]:
    """The plain names an assignment statement binds (tuple targets unpacked)."""
    if isinstance(statement, ast.Assign):
        targets = statement.targets
    elif isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
        targets = [statement.target]
    else:
        return []
    names = []
    for target in targets:
        elements = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
        names += [element.id for element in elements if isinstance(element, ast.Name)]
    return names


class SourceTree:
    """One copy of vLLM's Python source under ``root`` (the directory holding ``vllm/``), read as syntax trees."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._parsed: dict[str, ast.Module] = {}
        self._bindings: dict[str, tuple[dict[str, Any], list[str]]] = {}
        self._mro: dict[tuple[str, str], list[tuple[str, ast.ClassDef]]] = {}

    def path(self, module: str) -> Path | None:
        """The file of vLLM's ``module`` (a package's ``__init__.py``, or the directory of a namespace package)."""
        if module.split(".")[0] != "vllm":
            return None
        base = self.root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return base if base.is_dir() else None

    def file(self, module: str) -> str:
        """``module``'s file relative to the root, as shown in reports."""
        path = self.path(module)
        return path.relative_to(self.root).as_posix() if path is not None else ""

    def parsed(self, module: str) -> ast.Module:
        """``module``'s syntax tree (empty for a namespace package)."""
        if module not in self._parsed:
            path = self.path(module)
            source = path.read_text() if path is not None and path.is_file() else ""
            if source not in PARSED:
                PARSED[source] = ast.parse(source)
            self._parsed[module] = PARSED[source]
        return self._parsed[module]

    def bindings(self, module: str) -> tuple[dict[str, Any], list[str]]:
        """The names ``module`` binds at its top level (each to its defining node or an `Imported`), and the
        modules it star-imports."""
        if module not in self._bindings:
            names: dict[str, Any] = {}
            stars: list[str] = []
            for statement in top_level(self.parsed(module).body):
                if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names[statement.name] = statement
                elif isinstance(statement, ast.Import):
                    for alias in statement.names:
                        if alias.asname:
                            names[alias.asname] = Imported(alias.name, None)
                        else:
                            top = alias.name.split(".")[0]
                            names[top] = Imported(top, None)
                elif isinstance(statement, ast.ImportFrom):
                    source = self.absolute(module, statement)
                    for alias in statement.names:
                        if alias.name == "*":
                            stars.append(source)
                        else:
                            names[alias.asname or alias.name] = Imported(source, alias.name)
                else:
                    names.update(dict.fromkeys(assigned_names(statement), statement))
            self._bindings[module] = names, stars
        return self._bindings[module]

    def absolute(self, module: str, statement: ast.ImportFrom) -> str:
        """The absolute module an ``from ... import`` statement of ``module`` names."""
        if not statement.level:
            return statement.module or ""
        path = self.path(module)
        package = module.split(".") if path is not None and path.name == "__init__.py" else module.split(".")[:-1]
        base = package[: len(package) - statement.level + 1]
        return ".".join([*base, statement.module] if statement.module else base)

    def lazy_names(self, module: str) -> set[str]:
        """Names a module with a PEP 562 ``__getattr__`` hands out: the string keys of its top-level dicts and
        the strings its ``__getattr__`` compares the name with."""
        names, _ = self.bindings(module)
        getter = names.get("__getattr__")
        if not isinstance(getter, ast.FunctionDef):
            return set()
        keys: set[str] = set()
        for statement in top_level(self.parsed(module).body):
            value = getattr(statement, "value", None)
            if isinstance(value, ast.Dict):
                keys |= {key.value for key in value.keys if isinstance(getattr(key, "value", None), str)}
        for node in ast.walk(getter):
            if isinstance(node, ast.Compare):
                keys |= {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        return keys

    def resolve(self, module: str, name: str, seen: frozenset[tuple[str, str]] = frozenset()) -> tuple[str, Any]:
        """Where ``module.name`` is defined: ``(defining module, node)``, the node a def, class or assignment,
        or ``(submodule, None)`` for a submodule; ``("", None)`` where this copy defines no such name and
        ``(module, "lazy")`` for a name only a PEP 562 ``__getattr__`` hands out. Imports and star imports are
        followed within this copy; a name imported from outside vLLM resolves to ``(that module, "external")``.
        """
        if (module, name) in seen:
            return "", None
        seen = seen | {(module, name)}
        names, stars = self.bindings(module)
        bound = names.get(name)
        if isinstance(bound, Imported):
            if bound.name is None:
                return (bound.module, None) if self.path(bound.module) else (bound.module, "external")
            if not bound.module.startswith("vllm"):
                return bound.module, "external"
            found = self.resolve(bound.module, bound.name, seen)
            if found[0] or not self.path(f"{bound.module}.{bound.name}"):
                return found
            return f"{bound.module}.{bound.name}", None
        if bound is not None:
            return module, bound
        if self.path(f"{module}.{name}"):
            return f"{module}.{name}", None
        for star in stars:
            found = self.resolve(star, name, seen)
            if found[0]:
                return found
        return (module, "lazy") if name in self.lazy_names(module) else ("", None)

    def base_classes(self, module: str, node: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        """The bases of a class that are classes of this copy (``Generic[T]``'s and outside classes dropped)."""
        bases = []
        for expression in node.bases:
            while isinstance(expression, ast.Subscript):
                expression = expression.value
            found = self.resolve_expression(module, expression)
            if isinstance(found[1], ast.ClassDef):
                bases.append(found)
        return bases

    def resolve_expression(self, module: str, expression: ast.expr) -> tuple[str, Any]:
        """`resolve` for a name or a dotted attribute expression written in ``module``."""
        if isinstance(expression, ast.Name):
            return self.resolve(module, expression.id)
        if isinstance(expression, ast.Attribute):
            owner, node = self.resolve_expression(module, expression.value)
            if owner and node is None:
                return self.resolve(owner, expression.attr)
        return "", None

    def mro(self, module: str, node: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        """The class's method resolution order among this copy's classes (C3, as Python computes it)."""
        key = (module, node.name)
        if key not in self._mro:
            self._mro[key] = [(module, node)]  # a class reached again through its own bases ends there
            self._mro[key] = self._linearized(module, node)
        return self._mro[key]

    def _linearized(self, module: str, node: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        sequences = [self.mro(*base) for base in self.base_classes(module, node)]
        sequences.append(self.base_classes(module, node))
        order = [(module, node)]
        sequences = [list(sequence) for sequence in sequences if sequence]
        while sequences:
            heads = [sequence[0] for sequence in sequences]
            head = next((h for h in heads if not any(h in sequence[1:] for sequence in sequences)), heads[0])
            order.append(head)
            sequences = [[entry for entry in sequence if entry != head] for sequence in sequences]
            sequences = [sequence for sequence in sequences if sequence]
        return order

    def members(self, module: str, node: ast.ClassDef) -> dict[str, Any]:
        """What the class's own body defines (defs, classes, class attributes), the attributes its methods set on
        ``self`` (``True`` for those) and the names it only annotates (`DECLARED`), by name."""
        if node not in MEMBERS:
            defined: dict[str, Any] = {}
            for statement in top_level(node.body):
                if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for inner in ast.walk(statement):
                        target = getattr(inner, "ctx", None)
                        if isinstance(target, ast.Store) and isinstance(inner, ast.Attribute):
                            if isinstance(inner.value, ast.Name) and inner.value.id == "self":
                                defined.setdefault(inner.attr, True)
            for statement in top_level(node.body):
                if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    defined[statement.name] = statement
                elif isinstance(statement, ast.AnnAssign) and statement.value is None:
                    defined.update(dict.fromkeys(set(assigned_names(statement)) - set(defined), DECLARED))
                else:
                    defined.update(dict.fromkeys(assigned_names(statement), statement))
            MEMBERS[node] = defined
        return MEMBERS[node]

    def member(self, module: str, node: ast.ClassDef, name: str) -> Step:
        """What ``name`` is on instances of the class: the first definition along its `mro`, else the first
        declaration (an annotation without a value: a mixin's word that the class it joins defines it)."""
        mro = self.mro(module, node)
        for wanted in (lambda found: found is not DECLARED, lambda found: found is DECLARED):
            for owner, cls in mro:
                found = self.members(owner, cls).get(name)
                if found is not None and wanted(found):
                    return self.step(owner, f"{cls.name}.{name}", found)
        if hasattr(type, name):  # what every class has (``__name__``, ``__init__``, ...)
            return Step("builtin", f"{node.name}.{name}", (), self.file(module))
        return Step("missing", f"{node.name}.{name}", (), self.file(module))

    def step(self, module: str, name: str, node: Any) -> Step:
        """The `Step` for ``node`` (as `resolve` and `members` give it) defined in ``module`` as ``name``."""
        if node is None:
            return Step("module", module, (), self.file(module))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Step("def", name, parameters(node), self.file(module))
        if isinstance(node, ast.ClassDef):
            return Step("class", name, (), self.file(module))
        if node == "external":
            return Step("external", f"{module}.{name.rsplit('.', 1)[-1]}", (), "")
        return Step("attribute", name, (), self.file(module))

    def lookup(self, module: str, names: Sequence[str]) -> list[Step]:
        """What ``module.names[0].names[1]...`` is, step by step, while the steps are modules and classes (an
        attribute or def ends the walk: what lies beyond is an instance's)."""
        steps: list[Step] = []
        if not self.path(module):
            return [Step("missing", module, (), "")]
        owner: tuple[str, Any] = (module, None)
        for name in names:
            where, node = owner
            if node is None:
                found = self.resolve(where, name)
                if not found[0]:
                    return [*steps, Step("missing", f"{where}.{name}", (), self.file(where))]
                steps.append(self.step(found[0], name if found[1] is not None else found[0], found[1]))
                owner = found
            elif isinstance(node, ast.ClassDef):
                steps.append(self.member(where, node, name))
                owner = ("", "end")
            else:
                break
        return steps

    def class_node(self, module: str, name: str) -> tuple[str, ast.ClassDef] | None:
        """The class ``module.name`` (after re-exports) in this copy, or None."""
        found = self.resolve(module, name) if self.path(module) else ("", None)
        return found if isinstance(found[1], ast.ClassDef) else None
