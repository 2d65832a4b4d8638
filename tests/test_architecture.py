"""The import graph: schemas is a leaf; producers and consumers never import each other;
ops, the composition root, may import everything. Also pins the public surfaces."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "producers", "consumers", "ops")
ALLOWED = {
    "schemas": {"schemas"},
    "producers": {"producers", "schemas"},
    "consumers": {"consumers", "schemas"},
    "ops": set(PACKAGES),
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_what_it_may(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules found in {package}"
    wrong = {
        str(path.relative_to(ROOT)): sorted(imports_of(path) - ALLOWED[package])
        for path in files
        if imports_of(path) - ALLOWED[package]
    }
    assert wrong == {}, f"forbidden imports: {wrong}"


# vllm runs in its own environment: the only code that imports it is the vLLM plugin (which
# runs inside vLLM) and the trainer's nccl/ipc transfer backends (vLLM's own trainer
# engines, for which the user installs vllm beside the trainer), and those only inside a
# function, so importing rollq never needs vllm.
VLLM_IMPORTERS = {"consumers/trainer/transfer.py", "ops/vllm_plugin/rollq_vllm_plugin.py"}


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
        "DeadLetter", "DecodeError", "Fields", "InferenceUnavailable", "StreamGroup",
        "RewardError", "RollqError", "ScoredGroup", "SequenceScore", "TrajectoryGroup",
        "TransientError", "UnknownVersionError", "broadcast", "decode", "decode_dead",
        "decode_scored", "decode_trajectory", "encode", "encode_dead", "encode_scores",
        "is_broadcast",
        "join_trajectory", "scored_rewards", "trajectory_ref",
    ])
    for name in schemas.__all__:
        assert hasattr(schemas, name)
