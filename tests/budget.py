"""The suite's time budget, kept by the suite itself (docs/development.md, "Time budget").

Every test's wall time (setup, call and teardown: a session fixture's start lands on the
first test that uses it) is added to its tier's, and the run ends with one line per tier.
A test may take at most ``CEILING_S[kind]`` seconds, its kind set by its markers:

- ``vllm`` (the integration tier, learning tests included): no ceiling here; each such test
  states its own ``pytest.mark.timeout``, and the tier's whole time is on the tier line;
- ``slow``: a test that runs real processes, servers or many rounds;
- anything else: a unit or Redis test.

A test over its ceiling fails the run (the exit status), named with its time, whatever its
own outcome: a long test must say what it is, and its time is then counted where the
budget expects it. The ceilings sit far above the slowest test of each kind measured on a
loaded machine (beside a second suite), so a busy machine does not fail the guard.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest

CEILING_S = {"unit": 30.0, "slow": 120.0}
"""Seconds a test of each kind may take (``vllm`` tests: no ceiling). Measured on 2 cores
(docs/development.md has the table): the slowest unit or Redis test took ~5 s quietly and
~11 s beside a second suite; the slowest ``slow`` test (not vLLM) ~45 s quietly."""

TIERS = ("unit", "fakeredis", "real redis-server", "redis cluster", "redis tls", "vllm")
"""Where a test's time is counted: ``vllm`` for the integration tier, else its Redis tier,
else ``unit``."""


@dataclass
class Budget:
    """What the hooks of ``tests/conftest.py`` record, and the verdict at the end."""

    tier: dict[str, str] = field(default_factory=dict)
    kind: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def collected(self, item: pytest.Item, redis_tier: str | None) -> None:
        vllm = item.get_closest_marker("vllm") is not None
        self.tier[item.nodeid] = "vllm" if vllm else (redis_tier or "unit")
        self.kind[item.nodeid] = ("vllm" if vllm else
                                  "slow" if item.get_closest_marker("slow") else "unit")

    def reported(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration

    def over_ceiling(self) -> dict[str, tuple[float, float]]:
        """Test id -> (seconds, its ceiling), for every test over its ceiling."""
        over = {}
        for nodeid, seconds in self.seconds.items():
            ceiling = CEILING_S.get(self.kind.get(nodeid, "unit"))
            if ceiling is not None and seconds > ceiling:
                over[nodeid] = (seconds, ceiling)
        return over

    def lines(self) -> list[str]:
        by_tier: dict[str, list[float]] = defaultdict(list)
        for nodeid, seconds in self.seconds.items():
            by_tier[self.tier.get(nodeid, "unit")].append(seconds)
        total = sum(sum(times) for times in by_tier.values())
        lines = [f"time by tier: {total:.0f} s in all"]
        for tier in TIERS:
            times = by_tier.get(tier, [])
            if times:
                lines.append(f"  {tier:<18} {sum(times):7.0f} s  {len(times):5d} tests  "
                             f"slowest {max(times):.1f} s")
        for nodeid, (seconds, ceiling) in sorted(self.over_ceiling().items()):
            lines.append(f"OVER CEILING: {nodeid} took {seconds:.1f} s (ceiling "
                         f"{ceiling:.0f} s for a {self.kind.get(nodeid, 'unit')} test): mark "
                         "it for what it is, or make it cheaper")
        return lines
