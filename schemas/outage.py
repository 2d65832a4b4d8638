"""Riding out a Redis outage: how every long-running role keeps going through a restart.

A Redis restart (graceful, ``kill -9`` with AOF, a failover) looks to a client like a few
``BrokerUnavailable`` errors in a row. A role wraps each iteration of its loop in
``OutageRider.call``: while Redis is away it retries with bounded exponential back-off,
logs one line when the outage starts and one with its duration when it ends, and gives up
(re-raising ``BrokerUnavailable``, which the CLI turns into exit 69) only after
``give_up_s`` seconds of continuous failure. Work that was in hand when Redis went away is
not lost: its stream entries stay pending (redelivered after the outage) and rollout jobs
stay in arq's queue.

It lives in the leaf package because producers, consumers and ops all use it and may not
import each other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from schemas.errors import BrokerUnavailable

T = TypeVar("T")


class EventLogger(Protocol):
    """The part of a structlog logger the rider uses."""

    def warning(self, event: str, **fields: Any) -> Any: ...

    def error(self, event: str, **fields: Any) -> Any: ...


class OutageRider:
    """Retries a role's loop iteration through Redis outages of up to ``give_up_s``.

    - ``give_up_s``: seconds of continuous failure after which ``call`` re-raises.
    - ``what``: the role, for the log lines (``scorer``, ``feeder``…).
    - ``base_s``/``cap_s``: back-off of the n-th retry is ``min(cap_s, base_s · 2^n)``.
    - ``outages``: outages ridden out so far; ``down_since``: monotonic start of the
      current outage, None while Redis answers.
    """

    def __init__(self, *, give_up_s: float, what: str, log: EventLogger,
                 base_s: float = 0.05, cap_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if give_up_s < 0:
            raise ValueError(f"give_up_s must be >= 0, got {give_up_s}")
        self.give_up_s = give_up_s
        self.what = what
        self.log = log
        self.base_s = base_s
        self.cap_s = cap_s
        self.clock = clock
        self.outages = 0
        self.down_since: float | None = None
        self._attempt = 0

    async def call(self, step: Callable[[], Awaitable[T]]) -> T:
        """``await step()``, retried while Redis is unavailable (see the class doc)."""
        while True:
            try:
                result = await step()
            except BrokerUnavailable as exc:
                await self.failed(exc)
                continue
            self.recovered()
            return result

    async def failed(self, exc: BrokerUnavailable) -> None:
        """Record one failed attempt: log the outage's start, re-raise past the give-up
        time, else sleep the back-off. For loops that cannot be wrapped in ``call``."""
        now = self.clock()
        if self.give_up_s == 0:  # riding disabled: fail at once, as a one-shot command does
            raise exc
        if self.down_since is None:
            self.down_since = now
            self._attempt = 0
            self.log.warning("redis_outage_started", role=self.what, error=str(exc),
                             give_up_s=self.give_up_s)
        elif now - self.down_since >= self.give_up_s:
            self.log.error("redis_outage_gave_up", role=self.what,
                           seconds=round(now - self.down_since, 3), error=str(exc))
            self.down_since = None
            raise exc
        self._attempt += 1
        await asyncio.sleep(min(self.cap_s, self.base_s * 2.0 ** self._attempt))

    def recovered(self) -> float | None:
        """Record a successful attempt; returns the outage's duration if one just ended."""
        if self.down_since is None:
            return None
        seconds = self.clock() - self.down_since
        self.down_since = None
        self.outages += 1
        self.log.warning("redis_outage_ended", role=self.what, seconds=round(seconds, 3))
        return seconds
