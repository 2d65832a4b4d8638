"""Riding out a Redis outage: how every long-running role keeps going through a restart.

A Redis restart (graceful, ``kill -9`` with AOF, a failover) looks to a client like a few
``BrokerUnavailable`` errors in a row. A role wraps each iteration of its loop in
``OutageRider.call``: while Redis is away it retries with bounded exponential back-off,
logs one line when the outage starts and one with its duration when it ends, and gives up
(re-raising ``BrokerUnavailable``, which the CLI turns into exit 69) only after
``give_up_s`` seconds of continuous failure. Work that was in hand when Redis went away is
not lost: its stream entries stay pending (redelivered after the outage) and rollout jobs
stay in arq's queue.

A stop (SIGINT/SIGTERM) must not wait for Redis: given the role's ``stop`` event, the rider
raises ``StoppedDuringOutage`` as soon as the stop is set while Redis is away, from its
back-off or from a retried step it cancels (outside an outage a step runs to its end, so the
work in hand finishes as in any stop). The role then stops as it would normally.

It lives in the leaf package because producers, consumers and ops all use it and may not
import each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Protocol, TypeVar

from rollq.schemas.errors import BrokerUnavailable, RollqError

T = TypeVar("T")


class EventLogger(Protocol):
    """The part of a structlog logger the rider uses."""

    def warning(self, event: str, **fields: Any) -> Any: ...

    def error(self, event: str, **fields: Any) -> Any: ...


class StoppedDuringOutage(RollqError):
    """The role was told to stop while Redis was away: stop now, as after a normal stop
    (nothing in hand is lost: entries stay pending, jobs stay queued)."""


class OutageRider:
    """Retries a role's loop iteration through Redis outages of up to ``give_up_s``.

    - ``give_up_s``: seconds of continuous failure after which ``call`` re-raises.
    - ``what``: the role, for the log lines (``scorer``, ``feeder``…).
    - ``base_s``/``cap_s``: back-off of the n-th retry is ``min(cap_s, base_s · 2^n)``.
    - ``stop``: the role's stop event; set during an outage, ``call``/``failed`` raise
      ``StoppedDuringOutage`` at once (None: ride until Redis answers or give up).
    - ``connection``: which of the role's connections this rider watches (``data``,
      ``queue``), named in its log lines when given.
    - ``outages``: outages ridden out so far; ``down_since``: monotonic start of the
      current outage, None while Redis answers.
    """

    def __init__(self, *, give_up_s: float, what: str, log: EventLogger,
                 base_s: float = 0.05, cap_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic,
                 stop: asyncio.Event | None = None, connection: str | None = None) -> None:
        if give_up_s < 0:
            raise ValueError(f"give_up_s must be >= 0, got {give_up_s}")
        self.give_up_s = give_up_s
        self.what = what
        self.log = log
        self.base_s = base_s
        self.cap_s = cap_s
        self.clock = clock
        self.stop = stop
        self.named = {"connection": connection} if connection else {}
        self.outages = 0
        self.down_since: float | None = None
        self._attempt = 0

    async def call(self, step: Callable[[], Awaitable[T]]) -> T:
        """``await step()``, retried while Redis is unavailable (see the class doc)."""
        while True:
            try:
                result = await (step() if self.down_since is None else self._unless_stopped(step))
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
                             give_up_s=self.give_up_s, **self.named)
        elif now - self.down_since >= self.give_up_s:
            self.log.error("redis_outage_gave_up", role=self.what,
                           seconds=round(now - self.down_since, 3), error=str(exc),
                           **self.named)
            self.down_since = None
            raise exc
        self._attempt += 1
        delay = min(self.cap_s, self.base_s * 2.0 ** self._attempt,
                    max(0.0, self.down_since + self.give_up_s - now))  # give up on time
        if self.stop is None:
            await asyncio.sleep(delay)
            return
        try:
            await asyncio.wait_for(self.stop.wait(), delay)
        except TimeoutError:
            return
        self._stopped()

    async def _unless_stopped(self, step: Callable[[], Awaitable[T]]) -> T:
        """``await step()``, cancelled when the stop is set first (during an outage only)."""
        if self.stop is None:
            return await step()
        if self.stop.is_set():
            self._stopped()
        attempt = asyncio.ensure_future(step())
        stopping = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({attempt, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not attempt.done():
                attempt.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await attempt  # its clean-up runs before the role's
        if attempt.cancelled():
            self._stopped()
        return attempt.result()

    def _stopped(self) -> NoReturn:
        seconds = round(self.clock() - (self.down_since or self.clock()), 3)
        self.log.warning("redis_outage_stopped", role=self.what, seconds=seconds, **self.named)
        self.down_since = None
        raise StoppedDuringOutage(f"{self.what} stopped during a Redis outage")

    def recovered(self) -> float | None:
        """Record a successful attempt; returns the outage's duration if one just ended."""
        if self.down_since is None:
            return None
        seconds = self.clock() - self.down_since
        self.down_since = None
        self.outages += 1
        self.log.warning("redis_outage_ended", role=self.what, seconds=round(seconds, 3),
                         **self.named)
        return seconds
