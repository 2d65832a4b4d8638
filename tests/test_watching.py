"""Each connection watched on its own (``ops.watching``): the probe fails where the role's
work fails (LOADING too), and an outage of one connection is ridden out by its rider."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
import structlog
from structlog.testing import capture_logs

from rollq.ops.watching import Watched, probe_command, ride_out
from rollq.schemas import BrokerUnavailable
from rollq.schemas.outage import OutageRider


class Loading:
    """A client whose server is loading its AOF: PING would answer, real commands do not
    (unit-test fake: a real server's LOADING window is too short to hit on purpose)."""

    def __init__(self, loading_for: int) -> None:
        self.left = loading_for

    async def execute_command(self, *command: object) -> object:
        if self.left > 0:
            self.left -= 1
            raise redis_errors.BusyLoadingError("Redis is loading the dataset in memory")
        return 0


def rider(connection: str) -> OutageRider:
    return OutageRider(give_up_s=30.0, what="workers", log=structlog.get_logger("t"),
                       base_s=0.0, cap_s=0.0, connection=connection)


async def test_loading_counts_as_down_and_is_one_outage() -> None:
    loading = Loading(loading_for=5)
    fake: aioredis.Redis = loading  # type: ignore[assignment]  # a fake client, see Loading
    queue = Watched(rider("queue"), probe_command(fake, "ZCARD", "q"))
    with capture_logs() as logs:
        await ride_out(BrokerUnavailable("arq failed"), [queue])
    assert [(entry["event"], entry["connection"]) for entry in logs] == [
        ("redis_outage_started", "queue"), ("redis_outage_ended", "queue")]


async def test_the_connection_that_failed_is_the_one_waited_for(
        real_redis: aioredis.Redis) -> None:
    down: aioredis.Redis = Loading(loading_for=3)  # type: ignore[assignment]  # a fake client
    watched = [Watched(rider("queue"), probe_command(real_redis, "ZCARD", "q")),
               Watched(rider("data"), probe_command(down, "HGET", "k", "f"))]
    with capture_logs() as logs:
        await ride_out(BrokerUnavailable("failed"), watched)
    assert {entry["connection"] for entry in logs} == {"data"}
    assert len(logs) == 2


async def test_a_probe_that_never_answers_gives_up() -> None:
    loading: aioredis.Redis = Loading(loading_for=10**9)  # type: ignore[assignment]  # a fake
    guard = OutageRider(give_up_s=0.2, what="workers", log=structlog.get_logger("t"),
                        base_s=0.01, cap_s=0.05, connection="queue")
    with pytest.raises(BrokerUnavailable):
        await asyncio.wait_for(ride_out(BrokerUnavailable("x"), [
            Watched(guard, probe_command(loading, "ZCARD", "q"))]), 5)
