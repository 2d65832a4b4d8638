"""What the suite ran where, and its time budget (docs/development.md, "Time budget").

Each test is classified at collection: its Redis tier (fakeredis, a real redis-server, the
cluster, TLS; or none), whether it is in the vLLM tier, and its *kind* by its markers:

- ``vllm`` (the integration tier, learning tests included): no ceiling here; each such test
  states its own ``pytest.mark.timeout``, and the tier's whole time is on its line;
- ``slow``: a test that runs real processes, servers or many rounds;
- anything else: a unit or Redis test.

The classification travels on the test's reports (``user_properties``), so the counting
works the same in one process and under pytest-xdist, where the controller sees only
reports. Every report's duration (setup, call, teardown: a session fixture's start lands on
the first test that uses it) is added to the test's time. The run ends with one line per
tier (outcomes, as CI has always printed them) and a time table by tier. A test over its
kind's ceiling fails the run, named with its time, whatever its own outcome: a long test
must say what it is, so that its time is counted where the budget expects it.

A learning test states what it measured (``record_figures``): every run of the suite then
prints those figures at the end, pass or fail, so a bar's spread is read off CI runs, not
remembered.

``.ci/test`` runs the suite as two pytest runs (the tiers without vLLM spread over worker
processes, then the vLLM tier in one); with ``ROLLQ_SUITE_RECORD`` naming a file, each run
adds its tests to that file, and the lines printed are the whole suite's so far.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CEILING_S = {"unit": 60.0, "slow": 300.0}
"""Seconds a test of each kind may take (``vllm`` tests: no ceiling). Twice the slowest of
each kind measured under two pytest-xdist workers beside three other jobs on 2 cores (load
8-12: unit 26 s, slow 142 s; docs/development.md has the table), so a busy machine does
not fail the guard; a test that needs more must say what it is."""

REDIS_TIERS = {
    "fakeredis": "",
    "real redis-server": " (a server this test session started)",
    "redis cluster": " (3 masters + 3 replicas this test session started)",
    "redis tls": " (a TLS-only server with a test CA and ACL users)",
}
SLOWEST = 15
"""How many of the slowest tests the time table names."""
TIME_TIERS = ("unit", *REDIS_TIERS, "vllm")
"""Where a test's time is counted: ``vllm`` for the integration tier, else its Redis tier,
else ``unit``."""


@dataclass
class TestRecord:
    redis_tier: str | None
    vllm: bool
    kind: str
    seconds: float = 0.0
    outcomes: list[str] = field(default_factory=list)
    figures: str | None = None

    @property
    def time_tier(self) -> str:
        return "vllm" if self.vllm else (self.redis_tier or "unit")


FIGURES = "rollq_figures"


def record_figures(request: pytest.FixtureRequest, text: str) -> None:
    """What a learning test measured (its start, its end, its bar), printed at the end of
    the run whatever the outcome. Call it before the asserts."""
    request.node.user_properties.append((FIGURES, text))


def classify(item: pytest.Item, redis_tier: str | None) -> None:
    """Put the test's tier and kind on every report it will make."""
    vllm = item.get_closest_marker("vllm") is not None
    kind = "vllm" if vllm else "slow" if item.get_closest_marker("slow") else "unit"
    item.user_properties.append(("rollq_test", {"redis_tier": redis_tier, "vllm": vllm,
                                                "kind": kind}))


@dataclass
class SuiteRecord:
    tests: dict[str, TestRecord] = field(default_factory=dict)

    def reported(self, report: pytest.TestReport) -> None:
        properties = dict(report.user_properties)
        if "rollq_test" not in properties:
            return
        record = self.tests.get(report.nodeid)
        if record is None:
            record = self.tests[report.nodeid] = TestRecord(**properties["rollq_test"])
        record.seconds += report.duration
        if FIGURES in properties:
            record.figures = str(properties[FIGURES])
        # a test's outcome: its call, or the setup (or teardown) that failed or skipped it
        if report.when == "call" or report.outcome != "passed":
            record.outcomes.append(report.outcome)

    def merge(self, path: Path) -> None:
        """Add the tests recorded in ``path`` by earlier runs, then write all of them there."""
        if path.exists():
            earlier = json.loads(path.read_text())
            for nodeid, fields in earlier.items():
                self.tests.setdefault(nodeid, TestRecord(**fields))
        path.write_text(json.dumps({nodeid: vars(record)
                                    for nodeid, record in self.tests.items()}))

    def over_ceiling(self) -> dict[str, tuple[float, float]]:
        """Test id -> (seconds, its ceiling), for every test over its kind's ceiling."""
        over = {}
        for nodeid, record in self.tests.items():
            ceiling = CEILING_S.get(record.kind)
            if ceiling is not None and record.seconds > ceiling:
                over[nodeid] = (record.seconds, ceiling)
        return over

    def tier_lines(self) -> list[str]:
        """One line per Redis tier and one for the vLLM tier, outcomes counted, so CI's
        output shows that the real-server tests ran."""
        lines = []
        for tier, where in REDIS_TIERS.items():
            lines.append(f"redis tier {tier}{where}: " + _counts(
                [r for r in self.tests.values() if r.redis_tier == tier]))
        lines.append("vllm tier (a real CPU vLLM server this test session started): "
                     + _counts([r for r in self.tests.values() if r.vllm]))
        return lines

    def time_lines(self) -> list[str]:
        by_tier: dict[str, list[float]] = defaultdict(list)
        for record in self.tests.values():
            by_tier[record.time_tier].append(record.seconds)
        total = sum(sum(times) for times in by_tier.values())
        lines = [f"time by tier (test time, setup to teardown): {total:.0f} s in all"]
        for tier in TIME_TIERS:
            if times := by_tier.get(tier, []):
                lines.append(f"  {tier:<18} {sum(times):7.0f} s  {len(times):5d} tests  "
                             f"slowest {max(times):.1f} s")
        slowest = sorted(self.tests.items(), key=lambda kv: -kv[1].seconds)[:SLOWEST]
        lines.append(f"slowest {len(slowest)} tests:")
        lines += [f"  {record.seconds:7.1f} s  {record.kind:<5} {nodeid}"
                  for nodeid, record in slowest]
        for nodeid, (seconds, ceiling) in sorted(self.over_ceiling().items()):
            lines.append(f"OVER CEILING: {nodeid} took {seconds:.1f} s (ceiling {ceiling:.0f} "
                         f"s for a {self.tests[nodeid].kind} test): mark it for what it is, "
                         "or make it cheaper")
        return lines


    def figure_lines(self) -> list[str]:
        return [f"figures: {nodeid}: {record.figures}"
                for nodeid, record in sorted(self.tests.items()) if record.figures]


def _counts(records: list[TestRecord]) -> str:
    outcomes: dict[str, int] = defaultdict(int)
    for record in records:
        for outcome in record.outcomes:
            outcomes[outcome] += 1
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items())) or \
        "no tests ran"


def is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")
