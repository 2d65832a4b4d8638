"""The import graph, the installed package and module sizes (docs/development.md).

- Imports only go down: bench -> ops -> {consumers, producers} -> schemas; producers and
  consumers never import each other; inside ops, the CLI is the top floor, the laptop stack
  (ops.local) and the roles' wiring stand beside each other, the plumbing they share below.
- No import circle anywhere (imports inside functions count: they are arrows too).
- Everything is imported as ``rollq.<folder>``: a bare ``import schemas`` would load a
  second copy of a module from a checkout and fail once installed.
- torch, transformers and matplotlib only in ops.local (and the trainer SDK's optional
  paths); vllm only where it runs (the plugin) or is the user's (the nccl/ipc backends).
- No module over 500 lines; the public surfaces (``rollq``, ``schemas``) are pinned.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "producers", "consumers", "ops")
ALLOWED = {
    "schemas": {"schemas"},
    "producers": {"producers", "schemas"},
    "consumers": {"consumers", "schemas"},
    "ops": set(PACKAGES),
    "bench": {*PACKAGES, "bench"},
}
PLUGIN = "ops/vllm_plugin/rollq_vllm_plugin.py"  # installed into vLLM's environment, alone


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    found = {}
    for top in (*PACKAGES, "bench"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() != PLUGIN:
                found[_module(path)] = path
    return found


def _imported_names(path: Path) -> list[str]:
    """Every module name ``path`` imports, anywhere in it (functions included)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


@cache
def _graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (``rollq.`` taken off)."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for imported in _imported_names(path):
            target = imported.removeprefix("rollq.")
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


@pytest.mark.parametrize("package", [*PACKAGES, "bench"])
def test_package_imports_only_what_it_may(package: str) -> None:
    wrong = {name: sorted(t for t in targets if t.split(".")[0] not in ALLOWED[package])
             for name, targets in _graph().items() if name.split(".")[0] == package}
    assert {k: v for k, v in wrong.items() if v} == {}
    assert any(name.split(".")[0] == package for name in _graph()), "no imports seen"


def test_everything_is_imported_under_rollq() -> None:
    bare = {}
    for path in [*_modules().values(), *sorted((ROOT / "tests").rglob("*.py")),
                 *sorted((ROOT / "examples").rglob("*.py"))]:
        found = [n for n in _imported_names(path) if n.split(".")[0] in PACKAGES]
        if found:
            bare[path.relative_to(ROOT).as_posix()] = found
    assert bare == {}, "import these as rollq.<name>"


OPS_FLOORS = {
    "ops.cli": (3, "cli"), "ops.__main__": (3, "cli"), "ops.docs_settings": (3, "cli"),
    "ops.local": (2, "local"),
    "ops.roles": (2, "roles"), "ops.rescore": (2, "roles"),
    "ops.atropos": (2, "atropos"), "ops.gateway": (2, "gateway"),
}
"""Floors of ops (LAYOUT.md) and the rooms on them; every other ops module is plumbing,
floor 1. A module may import its own room's and the floors below."""


def _floor(name: str) -> tuple[int, str]:
    for prefix, (floor, room) in OPS_FLOORS.items():
        if name == prefix or name.startswith(prefix + "."):
            return floor, room
    return 1, "plumbing"


def test_ops_imports_go_down_only() -> None:
    up = []
    for name, targets in _graph().items():
        if not name.startswith("ops"):
            continue
        floor, group = _floor(name)
        for target in targets:
            if not target.startswith("ops."):
                continue
            target_floor, target_group = _floor(target)
            sideways = target_floor == floor and floor == 2 and target_group != group
            if target_floor > floor or sideways:
                up.append(f"{name} -> {target}")
    assert up == []
    assert not [t for t in _graph()["ops.local.demo"] if t.startswith("ops.cli")]


def test_no_import_circle() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(_modules()):
        if node not in index:
            visit(node)
    assert circles == []


HEAVY = ("torch", "transformers", "matplotlib")
HEAVY_ALLOWED = {"ops.local", "consumers.trainer", "producers.inference.capture.render"}
"""Where torch, transformers or matplotlib may be imported (inside functions, outside
ops.local: the trainer SDK's to_torch and ranks, the gateway's optional local render)."""


def test_heavy_libraries_only_where_they_are_needed() -> None:
    wrong = {}
    for name, path in _modules().items():
        if name.startswith("bench") or any(name == a or name.startswith(a + ".")
                                           for a in HEAVY_ALLOWED):
            continue
        heavy = [n for n in _imported_names(path) if n.split(".")[0] in HEAVY]
        if heavy:
            wrong[name] = heavy
    assert wrong == {}


def test_no_module_over_500_lines() -> None:
    paths = [*_modules().values(), *(ROOT / "tests").rglob("*.py"),
             *(ROOT / "examples").rglob("*.py"), ROOT / PLUGIN]
    long = {p.relative_to(ROOT).as_posix(): n for p in paths
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_installed_packages_are_the_folders_under_rollq() -> None:
    """``rollq/`` links each folder, so the wheel holds ``rollq.schemas``, ... and no
    generic top-level name (the fresh-venv test installs it: tests/test_install.py)."""
    for package in PACKAGES:
        link = ROOT / "rollq" / package
        assert link.is_symlink() and link.resolve() == (ROOT / package).resolve()
    import rollq

    assert sorted(rollq.__all__) == sorted(rollq._WHERE)  # the lazy table and __all__ agree
    for name in rollq.__all__:
        assert getattr(rollq, name) is not None


# vllm runs in its own environment: the only code that imports it is the vLLM plugin (which
# runs inside vLLM) and the trainer's nccl/ipc transfer backends (vLLM's own trainer
# engines, for which the user installs vllm beside the trainer), and those only inside a
# function, so importing rollq never needs vllm.
VLLM_IMPORTERS = {"consumers/trainer/transfer.py", PLUGIN}


def _vllm_imports(nodes: list[ast.AST]) -> list[str]:
    names = [alias.name for node in nodes if isinstance(node, ast.Import)
             for alias in node.names]
    names += [node.module or "" for node in nodes if isinstance(node, ast.ImportFrom)]
    return [n for n in names if n == "vllm" or n.startswith("vllm.")]


def test_project_code_never_hard_imports_vllm() -> None:
    lazy_importers = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            functions = [node for node in ast.walk(tree)
                         if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
            inside = {id(n) for f in functions for n in ast.walk(f)}
            top = [n for n in ast.walk(tree) if id(n) not in inside]
            assert not _vllm_imports(top), f"{path}: vllm imported at module level"
            if _vllm_imports(list(ast.walk(tree))):
                lazy_importers.add(path.relative_to(ROOT).as_posix())
    assert lazy_importers == VLLM_IMPORTERS


def test_schemas_public_surface_is_pinned() -> None:
    from rollq import schemas

    assert sorted(schemas.__all__) == sorted([
        "SCHEMA_VERSION", "BrokerUnavailable", "Completion", "ConfigError", "ContractError",
        "SamplingRecord",
        "DeadLetter", "DecodeError", "Fields", "InferenceUnavailable", "StreamGroup",
        "RewardError", "RollqError", "ScoredGroup", "SequenceScore", "TrajectoryGroup",
        "TransientError", "UnknownVersionError", "broadcast", "decode", "decode_dead",
        "decode_scored", "decode_trajectory", "encode", "encode_dead", "encode_scores",
        "is_broadcast",
        "join_trajectory", "scored_rewards", "trajectory_ref",
    ])
    for name in schemas.__all__:
        assert hasattr(schemas, name)
