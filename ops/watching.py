"""Watching each connection a role depends on, each with a probe on its failing path.

The worker pool depends on two servers that may fail apart: the data plane (``redis_url``:
the streams its groups go to) and the control plane (``queue_url``: arq's job queue). When
arq's loop fails, the pool must wait for the server that failed, not for one that answers:
a PING of the data plane answers while the queue's server is down, and a PING answers
during AOF loading while every real command gets ``LOADING``. So each connection has its own
``OutageRider`` (one ``redis_outage_started`` and one ``redis_outage_ended`` line per
outage, ``connection`` naming it, and ``redis_give_up_s`` counted from the outage's start)
and a probe that sends a real command of the kind the role sends on it (``BusyLoadingError``
is a connection error, so loading counts as down).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from rollq.schemas import BrokerUnavailable
from rollq.schemas.errors import translated_errors
from rollq.schemas.outage import OutageRider

Probe = Callable[[], Awaitable[object]]


@dataclass(frozen=True)
class Watched:
    """One connection of a role: its rider and its probe."""

    rider: OutageRider
    probe: Probe


def probe_command(redis: aioredis.Redis, *command: str | int) -> Probe:
    """A probe that sends ``command`` (a real read the role's own work depends on) on
    ``redis``; a connection failure or ``LOADING`` raises ``BrokerUnavailable``."""

    async def probe() -> object:
        async with translated_errors("probing"):
            return await redis.execute_command(  # type: ignore[no-untyped-call]
                *command)  # (redis-py leaves it untyped)

    return probe


async def ride_out(failure: BrokerUnavailable, watched: Sequence[Watched]) -> None:
    """After ``failure`` of a loop that uses every connection in ``watched``: wait until the
    connection that failed answers again (its rider's lines, back-off and give-up), or
    raise. When every probe answers at once, the failure is ridden out as one of the first
    connection's (a command failed on a server that answers: back off before the loop
    tries again)."""
    for connection in watched:
        try:
            await connection.probe()
        except BrokerUnavailable as down:
            await connection.rider.failed(down)
            await connection.rider.call(connection.probe)
            return
    first = watched[0]
    await first.rider.failed(failure)
    await first.rider.call(first.probe)
