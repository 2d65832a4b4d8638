"""OutageRider: retries through an outage, one line at its start and end, gives up on time."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from rollq.schemas import BrokerUnavailable
from rollq.schemas.outage import OutageRider, StoppedDuringOutage


class Flaky:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise BrokerUnavailable(f"down (call {self.calls})")
        return "ok"


def rider(give_up_s: float, clock: list[float]) -> OutageRider:
    import structlog

    return OutageRider(give_up_s=give_up_s, what="test", log=structlog.get_logger("t"),
                       base_s=0.0, cap_s=0.0, clock=lambda: clock[0])


async def test_rides_out_an_outage_and_logs_it_once() -> None:
    clock = [0.0]
    step = Flaky(failures=5)
    guard = rider(10.0, clock)
    with capture_logs() as logs:
        assert await guard.call(step) == "ok"
    assert step.calls == 6
    events = [entry["event"] for entry in logs]
    assert events == ["redis_outage_started", "redis_outage_ended"]
    assert guard.outages == 1 and guard.down_since is None


async def test_gives_up_after_the_give_up_time() -> None:
    clock = [0.0]
    guard = rider(3.0, clock)

    async def always_down() -> None:
        clock[0] += 1.0
        raise BrokerUnavailable("down")

    with capture_logs() as logs, pytest.raises(BrokerUnavailable):
        await guard.call(always_down)
    assert logs[-1]["event"] == "redis_outage_gave_up"
    assert logs[-1]["seconds"] >= 3.0


async def test_other_errors_pass_through() -> None:
    guard = rider(3.0, [0.0])

    async def broken() -> None:
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        await guard.call(broken)


async def test_a_stop_during_an_outage_ends_the_back_off_at_once() -> None:
    import asyncio

    import structlog

    stop = asyncio.Event()
    guard = OutageRider(give_up_s=300.0, what="test", log=structlog.get_logger("t"),
                        base_s=30.0, cap_s=30.0, stop=stop)

    async def always_down() -> None:
        raise BrokerUnavailable("down")

    asyncio.get_running_loop().call_later(0.2, stop.set)
    with capture_logs() as logs, pytest.raises(StoppedDuringOutage):
        await asyncio.wait_for(guard.call(always_down), 5)  # not the 30 s back-off
    assert [entry["event"] for entry in logs] == ["redis_outage_started",
                                                  "redis_outage_stopped"]
    assert guard.down_since is None


async def test_a_stop_cancels_a_retried_step_that_hangs_but_not_a_first_one() -> None:
    import asyncio

    import structlog

    stop = asyncio.Event()
    guard = OutageRider(give_up_s=300.0, what="test", log=structlog.get_logger("t"),
                        base_s=0.0, cap_s=0.0, stop=stop)
    calls: list[str] = []

    async def down_then_hanging() -> str:
        calls.append("call")
        if len(calls) == 1:
            raise BrokerUnavailable("down")
        await asyncio.sleep(60)  # a retry that never answers (a hung server)
        return "late"

    asyncio.get_running_loop().call_later(0.2, stop.set)
    with pytest.raises(StoppedDuringOutage):
        await asyncio.wait_for(guard.call(down_then_hanging), 5)
    assert len(calls) == 2

    async def in_hand() -> str:  # outside an outage the work in hand finishes
        await asyncio.sleep(0.1)
        return "done"

    assert await guard.call(in_hand) == "done"


async def test_the_back_off_never_sleeps_past_the_give_up_time() -> None:
    import asyncio
    import time

    import structlog

    guard = OutageRider(give_up_s=0.5, what="test", log=structlog.get_logger("t"),
                        base_s=10.0, cap_s=10.0)

    async def always_down() -> None:
        raise BrokerUnavailable("down")

    started = time.monotonic()
    with pytest.raises(BrokerUnavailable):
        await asyncio.wait_for(guard.call(always_down), 5)
    # gave up at 0.5 s, inside the first 10 s back-off (margin for a loaded machine)
    assert 0.5 <= time.monotonic() - started < 5
