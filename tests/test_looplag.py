"""LoopLagMonitor sees a blocked loop and reports it."""

from __future__ import annotations

import asyncio
import time

from structlog.testing import capture_logs

from rollq.ops.looplag import LoopLagMonitor


async def test_a_blocking_call_shows_up_as_lag() -> None:
    with capture_logs() as logs:
        async with LoopLagMonitor("test", interval_s=0.01, report_every_s=0.0) as monitor:
            await asyncio.sleep(0.05)
            quiet = monitor.snapshot()
            time.sleep(0.2)  # noqa: ASYNC251  (blocks the loop on purpose, as sympy would)
            await asyncio.sleep(0.05)
            busy = monitor.snapshot()
    assert quiet.samples > 0 and quiet.max_ms < 150
    assert busy.max_ms >= 150
    assert any(entry["event"] == "event_loop_lag" for entry in logs)
