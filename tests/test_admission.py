"""Paced admission: the pure rule, and the feeder that applies it with Redis counters."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from rollq.producers.admission import admit, outstanding
from rollq.producers.feeder import Feeder, FeedPlan
from rollq.schemas.keys import POLICY_VERSION_FIELD, counters_key, state_key


@pytest.mark.parametrize(
    ("version", "consumed", "outstanding", "staleness", "batch", "expected"),
    [
        (0, 0, 0, 0, 8, 8),  # fresh run: one batch
        (0, 0, 0, 1, 8, 16),  # one version of slack: two batches
        (0, 0, 16, 1, 8, 0),  # budget used up (in flight + buffered)
        (1, 8, 8, 1, 8, 8),  # trainer stepped: a new batch is admitted
        (0, 0, 20, 1, 8, 0),  # over budget (after a restart): never negative
        (5, 40, 0, 0, 8, 8),
        (3, 0, 0, 2, 4, 24),
        (2, 20, 3, 0, 8, 1),  # one slot left
    ],
)
def test_admit(version: int, consumed: int, outstanding: int, staleness: int, batch: int,
               expected: int) -> None:
    assert admit(version, consumed, outstanding, max_staleness=staleness,
                 batch_groups=batch) == expected


def test_outstanding_counts_drops_but_not_duplicates() -> None:
    counters = {"consumed": 5, "scored": 9, "drop:stale": 2, "drop:duplicate": 3}
    assert outstanding(10, counters) == (5, 3)


async def test_feeder_pauses_when_the_trainer_lags_and_resumes(redis: aioredis.Redis) -> None:
    enqueued: list[int] = []

    async def enqueue(position: int) -> bool:
        enqueued.append(position)
        return True

    plan = FeedPlan(dataset_size=100, epochs=1, max_staleness=1, batch_groups=4)
    feeder = Feeder(redis, "run", plan, enqueue)
    assert await feeder.feed_once() == 8  # (1 + 0 + 1) * 4
    assert await feeder.feed_once() == 0  # paused: the trainer has not consumed or stepped
    await redis.hincrby(counters_key("run", 0), "consumed", 4)
    assert await feeder.feed_once() == 0  # consuming alone does not open the gate...
    await redis.hset(state_key("run"), POLICY_VERSION_FIELD, 1)
    assert await feeder.feed_once() == 4  # ...a new policy version does
    await redis.hincrby(counters_key("run", 0), "drop:zero_variance", 2)
    assert await feeder.feed_once() == 2  # dropped groups free their slots
    assert enqueued == list(range(14))


async def test_restarted_feeder_continues_from_the_cursor(redis: aioredis.Redis) -> None:
    seen: list[int] = []

    async def enqueue(position: int) -> bool:
        seen.append(position)
        return True

    plan = FeedPlan(dataset_size=5, epochs=2, max_staleness=10, batch_groups=1)
    assert await Feeder(redis, "run", plan, enqueue).feed_once() == 10  # capped by 2 epochs
    assert await Feeder(redis, "run", plan, enqueue).feed_once() == 0
    assert await Feeder(redis, "run", plan, enqueue).finished()
    assert seen == list(range(10))


async def test_run_until_stops_when_all_epochs_are_admitted(redis: aioredis.Redis) -> None:
    async def enqueue(position: int) -> bool:
        return True

    plan = FeedPlan(dataset_size=3, epochs=1, max_staleness=5, batch_groups=1)
    await asyncio.wait_for(Feeder(redis, "run", plan, enqueue).run_until(asyncio.Event(), 0.01), 5)
