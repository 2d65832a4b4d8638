"""The suite's record (``tests/budget.py``): tiers counted from reports, and the time guard."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.budget import CEILING_S, FIGURES, SuiteRecord


@dataclass
class Report:
    """What the record reads of a ``pytest.TestReport``."""

    nodeid: str
    when: str
    duration: float
    outcome: str = "passed"
    user_properties: list[tuple[str, Any]] = field(default_factory=list)


def _test(record: SuiteRecord, nodeid: str, phases: list[float], *, redis_tier: str | None = None,
          vllm: bool = False, kind: str = "unit", outcome: str = "passed") -> None:
    properties = [("rollq_test", {"redis_tier": redis_tier, "vllm": vllm, "kind": kind})]
    for when, seconds in zip(("setup", "call", "teardown"), phases, strict=False):
        record.reported(Report(nodeid, when, seconds,  # type: ignore[arg-type]  # duck-typed
                               outcome if when == "call" else "passed", properties))


def test_a_long_unmarked_test_is_over_its_ceiling_with_all_its_phases_counted() -> None:
    unit = CEILING_S["unit"]
    record = SuiteRecord()
    _test(record, "a", [1.0, unit - 1.5, 1.0])  # over only with its setup and teardown
    _test(record, "b", [0.1, unit + 10], redis_tier="fakeredis", kind="slow")
    _test(record, "c", [900.0, 0.5], redis_tier="real redis-server", vllm=True, kind="vllm")
    _test(record, "d", [0.5, 0.5], redis_tier="real redis-server", outcome="failed")
    assert record.over_ceiling() == {"a": (pytest.approx(unit + 0.5), unit)}
    times = record.time_lines()
    assert any(line.split()[:2] == ["vllm", "900"] for line in times)  # counted as vllm
    assert any(line.startswith("OVER CEILING: a took") for line in times)
    tiers = record.tier_lines()
    assert "redis tier real redis-server (a server this test session started): 1 failed, " \
           "1 passed" in tiers
    assert tiers[-1].endswith("started): 1 passed")
    assert tiers[0] == "redis tier fakeredis: 1 passed"


def test_a_slow_test_has_its_own_ceiling() -> None:
    slow = CEILING_S["slow"]
    record = SuiteRecord()
    _test(record, "b", [slow + 1], kind="slow")
    assert record.over_ceiling() == {"b": (slow + 1, slow)}


def test_runs_merge_through_a_file(tmp_path: Path) -> None:
    first, second = SuiteRecord(), SuiteRecord()
    _test(first, "a", [1.0, 2.0], redis_tier="fakeredis")
    first.merge(tmp_path / "suite.json")
    _test(second, "v", [50.0, 5.0], vllm=True, kind="vllm")
    second.merge(tmp_path / "suite.json")
    assert set(second.tests) == {"a", "v"}
    assert second.tier_lines()[0] == "redis tier fakeredis: 1 passed"
    assert second.time_lines()[0].endswith("58 s in all")


def test_a_learning_tests_figures_are_printed_pass_or_fail_across_runs(tmp_path: Path) -> None:
    first, second = SuiteRecord(), SuiteRecord()
    properties: list[tuple[str, Any]] = [
        ("rollq_test", {"redis_tier": None, "vllm": True, "kind": "vllm"})]
    first.reported(Report("learn", "call", 200.0, "failed",  # type: ignore[arg-type]
                          [*properties, (FIGURES, "0.345 -> 0.502, bar 0.545")]))
    _test(first, "quick", [0.1])
    first.merge(tmp_path / "suite.json")
    second.merge(tmp_path / "suite.json")
    assert second.figure_lines() == ["figures: learn: 0.345 -> 0.502, bar 0.545"]
    slowest = second.time_lines()[second.time_lines().index("slowest 2 tests:") + 1]
    assert slowest.split()[:3] == ["200.0", "s", "vllm"] and slowest.endswith("learn")
