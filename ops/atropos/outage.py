"""Riding out short Redis outages inside the Atropos API, so Atropos envs keep running.

atroposlib 0.4.0's env gives up quickly: ``/status-env`` is tried 3 times with random
exponential waits (about 1-4 s in all), then the env process exits; a post is retried as
briefly. So a request that finds Redis unreachable (a restart, a failover) is not
answered 503 at once: it is run again, with back-off, for up to ``hold_s`` seconds, and
answered when Redis is back; only a longer outage is a 503 (``broker_unavailable``).
Running a request again is safe: every state change it makes is one atomic Redis step
(a posted group is one script that also remembers its digest, a hand-out one
transaction), and a batch whose hand-out was not confirmed is handed out again, never
lost (``ops.atropos.store``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import redis.exceptions as redis_errors
import structlog
from fastapi import Request, Response
from fastapi.routing import APIRoute

from rollq.schemas import BrokerUnavailable

log = structlog.get_logger("rollq.atropos")

T = TypeVar("T")

FIRST_PAUSE_S = 0.1
LONGEST_PAUSE_S = 1.0


async def ride_out(call: Callable[[], Awaitable[T]], *, hold_s: float, what: str) -> T:
    """``await call()``, again while it fails for want of Redis, for up to ``hold_s``;
    then its ``BrokerUnavailable`` is raised. ``what`` names the call in the log."""
    started = time.monotonic()
    pause = FIRST_PAUSE_S
    waiting = False
    while True:
        try:
            result = await call()
        except (BrokerUnavailable, redis_errors.ConnectionError, redis_errors.TimeoutError,
                OSError) as exc:
            if time.monotonic() + pause > started + hold_s:
                if isinstance(exc, BrokerUnavailable):
                    raise
                raise BrokerUnavailable(f"redis unavailable for {hold_s:.0f} s: {exc}") from exc
            if not waiting:
                log.warning("redis_outage_held", what=what, hold_s=hold_s, detail=str(exc))
                waiting = True
            await asyncio.sleep(pause)
            pause = min(LONGEST_PAUSE_S, pause * 2)
            continue
        if waiting:
            log.info("redis_outage_ridden", what=what,
                     waited_s=round(time.monotonic() - started, 2))
        return result


def outage_riding_route(hold_s: float) -> type[APIRoute]:
    """A route class whose requests ride out Redis outages of up to ``hold_s`` seconds
    (``app.router.route_class``; 0 answers at once)."""

    class OutageRidingRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            if hold_s <= 0:
                return handler

            async def held(request: Request) -> Response:
                return await ride_out(lambda: handler(request), hold_s=hold_s,
                                      what=request.url.path)

            return held

    return OutageRidingRoute
