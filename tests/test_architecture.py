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


def test_project_code_never_hard_imports_vllm() -> None:
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                     for alias in node.names}
            names |= {node.module or "" for node in ast.walk(tree)
                      if isinstance(node, ast.ImportFrom)}
            assert not any(n == "vllm" or n.startswith("vllm.") for n in names), path


def test_schemas_public_surface_is_pinned() -> None:
    import schemas

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
