"""Event-loop lag of a role: how late a timer fires, the cost of anything that blocks the loop.

``LoopLagMonitor`` runs as a background task of a long-running role: every ``interval_s``
it sleeps and measures how much later than asked it woke. Every ``report_every_s`` it logs
one ``event_loop_lag`` line with the window's p50/p99/max in milliseconds (the soak
benchmark reads these), and ``snapshot()`` serves the same numbers to metrics.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
import structlog

log = structlog.get_logger("rollq.looplag")


@dataclass(frozen=True)
class LagSnapshot:
    p50_ms: float
    p99_ms: float
    max_ms: float
    samples: int


class LoopLagMonitor:
    """Measure and report event-loop lag; ``async with LoopLagMonitor(role):``."""

    def __init__(self, role: str, *, interval_s: float = 0.1, report_every_s: float = 30.0,
                 window: int = 1000) -> None:
        self.role = role
        self.interval_s = interval_s
        self.report_every_s = report_every_s
        self.window = window
        self._lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopLagMonitor:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def snapshot(self) -> LagSnapshot:
        """p50/p99/max of the recent window (zeros before the first sample)."""
        if not self._lags:
            return LagSnapshot(0.0, 0.0, 0.0, 0)
        lags = np.asarray(self._lags) * 1000
        return LagSnapshot(float(np.percentile(lags, 50)), float(np.percentile(lags, 99)),
                           float(lags.max()), len(lags))

    async def _run(self) -> None:
        reported = time.monotonic()
        while True:
            asked = time.monotonic()
            await asyncio.sleep(self.interval_s)
            self._lags.append(max(0.0, time.monotonic() - asked - self.interval_s))
            if len(self._lags) > self.window:
                del self._lags[: len(self._lags) - self.window]
            if time.monotonic() - reported >= self.report_every_s:
                reported = time.monotonic()
                lag = self.snapshot()
                log.info("event_loop_lag", role=self.role, p50_ms=round(lag.p50_ms, 2),
                         p99_ms=round(lag.p99_ms, 2), max_ms=round(lag.max_ms, 2),
                         samples=lag.samples)
