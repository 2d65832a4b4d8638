"""The suite's time guard (``tests/budget.py``): a long test must say what it is."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tests.budget import CEILING_S, Budget


@dataclass
class Item:
    nodeid: str
    markers: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.markers else None


@dataclass
class Report:
    nodeid: str
    duration: float


def _budget(*tests: tuple[Item, str | None, list[float]]) -> Budget:
    budget = Budget()
    for item, redis_tier, phases in tests:
        budget.collected(item, redis_tier)  # type: ignore[arg-type]  # duck-typed stand-ins
        for seconds in phases:  # setup, call, teardown
            budget.reported(Report(item.nodeid, seconds))  # type: ignore[arg-type]
    return budget


def test_a_long_unmarked_test_is_over_its_ceiling_with_all_its_phases_counted() -> None:
    unit = CEILING_S["unit"]
    budget = _budget((Item("a"), None, [1.0, unit - 1.5, 1.0]),  # over only with its setup
                     (Item("b", {"slow"}), "fakeredis", [unit + 10]),
                     (Item("c", {"vllm", "slow"}), "real redis-server", [900.0]),
                     (Item("d"), "real redis-server", [0.5]))
    assert budget.over_ceiling() == {"a": (pytest.approx(unit + 0.5), unit)}
    lines = budget.lines()
    assert lines[0] == f"time by tier: {unit + 0.5 + unit + 10 + 900.5:.0f} s in all"
    assert any(line.split()[:2] == ["vllm", "900"] for line in lines)  # counted as vllm
    assert any(line.startswith("OVER CEILING: a took") for line in lines)


def test_a_slow_test_has_its_own_ceiling() -> None:
    slow = CEILING_S["slow"]
    budget = _budget((Item("b", {"slow"}), "fakeredis", [slow + 1]))
    assert budget.over_ceiling() == {"b": (slow + 1, slow)}
