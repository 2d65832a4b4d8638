"""``Histogram``: a fixed-bucket distribution that roles keep in memory, free of any
metrics library (``ops.metrics`` exposes it to Prometheus when the ``metrics`` extra is
installed; without it nothing reads it and it costs one bisect per observation).

Bounds are upper bounds, as Prometheus ``le`` buckets; the ``+Inf`` bucket is implicit.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

SECONDS_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                  120.0, 300.0, 600.0)
"""Buckets for durations from milliseconds (a small batch) to minutes (a long generation)."""
VERSION_BOUNDS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0)
"""Buckets for staleness in policy versions."""


class Histogram:
    """Counts of observations at or below each bound, their sum and their count."""

    def __init__(self, bounds: Sequence[float] = SECONDS_BOUNDS) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("histogram bounds must be strictly increasing")
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs as Prometheus exposes them, ending with ``+Inf``."""
        buckets: list[tuple[str, int]] = []
        running = 0
        for bound, count in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            running += count
            buckets.append((bound, running))
        return buckets
