"""The feeder: admits rollout jobs at the pace the trainer can absorb.

Every ``poll_s`` it reads the trainer's policy version and the run's counters, asks
``admit`` how many jobs may start, and enqueues that many from the dataset cursor. The
cursor (``position``: epoch × dataset length + item index) and the ``admitted`` count are
kept in Redis and advanced together in one MULTI, after the enqueue. If the feeder dies
between the two, the restarted feeder enqueues the same position again, which arq refuses
(same job id): items are neither skipped nor repeated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from producers.admission import admit, outstanding
from schemas.keys import (
    ADMITTED_FIELD,
    PARTITIONS_FIELD,
    POLICY_VERSION_FIELD,
    counters_key,
    state_key,
)

log = structlog.get_logger("rollq.feeder")
CURSOR_FIELD = "cursor"

Enqueue = Callable[[int], Awaitable[bool]]


@dataclass(frozen=True)
class FeedPlan:
    dataset_size: int
    epochs: int
    max_staleness: int
    batch_groups: int

    @property
    def total(self) -> int:
        return self.dataset_size * self.epochs


@dataclass(frozen=True)
class FeedState:
    cursor: int
    version: int
    consumed: int
    outstanding: int

    def budget(self, plan: FeedPlan) -> int:
        free = admit(self.version, self.consumed, self.outstanding, 0,
                     max_staleness=plan.max_staleness, batch_groups=plan.batch_groups)
        return min(free, plan.total - self.cursor)


class Feeder:
    """Enqueues rollout jobs of one run while the admission budget allows."""

    def __init__(self, redis: aioredis.Redis, run: str, plan: FeedPlan, enqueue: Enqueue) -> None:
        self.redis = redis
        self.run = run
        self.plan = plan
        self.enqueue = enqueue

    async def read_state(self) -> FeedState:
        state = await self.redis.hgetall(state_key(self.run))
        partitions = int(state.get(PARTITIONS_FIELD.encode(), b"1"))
        counters: dict[str, int] = {}
        for p in range(partitions):
            for name, value in (await self.redis.hgetall(counters_key(self.run, p))).items():
                counters[name.decode()] = counters.get(name.decode(), 0) + int(value)
        consumed, pending = outstanding(int(state.get(ADMITTED_FIELD.encode(), b"0")), counters)
        return FeedState(
            cursor=int(state.get(CURSOR_FIELD.encode(), b"0")),
            version=int(state.get(POLICY_VERSION_FIELD.encode(), b"0")),
            consumed=consumed,
            outstanding=pending,
        )

    async def feed_once(self) -> int:
        """Admit as many jobs as the budget allows now; returns how many were admitted."""
        state = await self.read_state()
        budget = state.budget(self.plan)
        for offset in range(budget):
            position = state.cursor + offset
            fresh = await self.enqueue(position)
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(state_key(self.run), CURSOR_FIELD, str(position + 1))
            pipe.hincrby(state_key(self.run), ADMITTED_FIELD, 1)
            await pipe.execute()
            if not fresh:
                log.info("job_already_enqueued", position=position)
        if budget:
            log.info("jobs_admitted", count=budget, cursor=state.cursor + budget,
                     policy_version=state.version, consumed=state.consumed,
                     outstanding=state.outstanding)
        return budget

    @property
    def key(self) -> str:
        return state_key(self.run)

    async def finished(self) -> bool:
        cursor = await self.redis.hget(self.key, CURSOR_FIELD)
        return int(cursor or 0) >= self.plan.total

    async def run_until(self, stop: asyncio.Event, poll_s: float) -> None:
        """Feed until the dataset's epochs are all admitted or ``stop`` is set."""
        while not stop.is_set():
            await self.feed_once()
            if await self.finished():
                log.info("feeder_finished", total=self.plan.total)
                return
            try:
                await asyncio.wait_for(stop.wait(), poll_s)
            except TimeoutError:
                pass
