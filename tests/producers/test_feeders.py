"""Feeders are safe in any number: each position is enqueued once, ``admitted`` counts only
jobs actually created, and a feeder killed between enqueue and commit skips nothing."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
import structlog
from structlog.testing import capture_logs

from rollq.producers.feeder import CURSOR_FIELD, Feeder, FeedPlan
from rollq.producers.publisher import Publisher
from rollq.producers.worker import connect_queue, enqueue_rollout, queue_name
from rollq.schemas.keys import ADMITTED_FIELD, POLICY_VERSION_FIELD, counters_key, state_key
from rollq.schemas.outage import OutageRider
from tests.redis_server import RedisServer

RUN = "feeders"


@pytest.mark.parametrize("lease_s", [30.0, 0.001], ids=["lease", "leases-expiring-mid-feed"])
async def test_three_feeders_at_once_admit_each_position_once(
        lease_s: float, real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    """With the lease the feeders take turns; with leases that expire at once all three
    feed the same positions concurrently, and the idempotent enqueue + commit still count
    each position once."""
    await Publisher(real_redis, RUN).register()
    plan = FeedPlan(dataset_size=50, epochs=2, max_staleness=2, batch_groups=4)
    queues = [await connect_queue(redis_server.url) for _ in range(3)]
    clients = [aioredis.Redis.from_url(redis_server.url) for _ in range(3)]
    enqueued: list[int] = []
    refused: list[int] = []

    def feeder(index: int) -> Feeder:
        async def enqueue(position: int) -> bool:
            await asyncio.sleep(0)  # let the other feeders interleave
            created = await enqueue_rollout(queues[index], RUN, "toy", position)
            (enqueued if created else refused).append(position)
            return created

        return Feeder(clients[index], RUN, plan, enqueue, lease_s=lease_s)

    feeders = [feeder(i) for i in range(3)]
    try:
        for step in range(1, 40):  # the trainer steps and consumes; all three feed at once
            await asyncio.gather(*(f.feed_once() for f in feeders for _ in range(3)))
            await real_redis.hset(state_key(RUN), POLICY_VERSION_FIELD, step)
            await real_redis.hincrby(counters_key(RUN, 0), "consumed", 4)
            if await feeders[0].finished():
                break
    finally:
        for queue in queues:
            await queue.aclose()
        for client in clients:
            await client.aclose()
    assert sorted(enqueued) == list(range(100))  # every position once, none skipped
    if lease_s >= 1:  # with the lease held, no feeder enqueues a position another did
        assert not refused
    # (with leases expiring mid-feed they usually overlap, but how often is timing: the
    # assertions above hold either way, which is the point)
    assert int(await real_redis.hget(state_key(RUN), ADMITTED_FIELD)) == 100
    assert int(await real_redis.zcard(queue_name(RUN))) == 100
    assert int(await real_redis.hget(state_key(RUN), CURSOR_FIELD)) == 100


async def test_a_feeder_killed_between_enqueue_and_commit_skips_nothing(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    await Publisher(real_redis, RUN).register()
    plan = FeedPlan(dataset_size=10, epochs=1, max_staleness=10, batch_groups=1)
    queue = await connect_queue(redis_server.url)

    async def enqueue_then_die(position: int) -> bool:
        await enqueue_rollout(queue, RUN, "toy", position)
        if position == 3:
            raise SystemExit  # the process dies after the enqueue, before the commit
        return True

    async def enqueue(position: int) -> bool:
        return await enqueue_rollout(queue, RUN, "toy", position)

    try:
        try:
            await Feeder(real_redis, RUN, plan, enqueue_then_die, lease_s=0.2).feed_once()
        except SystemExit:
            pass
        assert int(await real_redis.hget(state_key(RUN), CURSOR_FIELD)) == 3
        await asyncio.sleep(0.25)  # its lease expires (it could not release it)
        assert await Feeder(real_redis, RUN, plan, enqueue).feed_once() == 7  # 3 (once), 4..9
    finally:
        await queue.aclose()
    assert int(await real_redis.hget(state_key(RUN), CURSOR_FIELD)) == 10
    assert int(await real_redis.hget(state_key(RUN), ADMITTED_FIELD)) == 10
    assert int(await real_redis.zcard(queue_name(RUN))) == 10


async def test_a_standby_feeder_waits_for_the_lease(redis: aioredis.Redis) -> None:
    plan = FeedPlan(dataset_size=10, epochs=1, max_staleness=10, batch_groups=1)

    async def enqueue(position: int) -> bool:
        return True

    active = Feeder(redis, RUN, plan, enqueue)
    await redis.set(active.lease_key, "someone-else", px=10_000)
    assert await active.feed_once() == 0
    await redis.delete(active.lease_key)
    assert await active.feed_once() == 10


async def test_a_failing_enqueue_is_logged_and_retried_from_the_cursor(
        redis: aioredis.Redis) -> None:
    """A write Redis refuses (OOM here) or a dropped connection while enqueueing does not
    end the feeder: it logs the outage and carries on from the position that failed."""
    refusals: list[Exception] = [
        redis_errors.ConnectionError("Connection reset by peer"),
        redis_errors.ResponseError("OOM command not allowed when used memory > 'maxmemory'"),
    ]
    enqueued: list[int] = []

    async def enqueue(position: int) -> bool:
        if position == 2 and refusals:
            raise refusals.pop()
        enqueued.append(position)
        return True

    plan = FeedPlan(dataset_size=5, epochs=1, max_staleness=10, batch_groups=1)
    rider = OutageRider(give_up_s=30, what="feeder", log=structlog.get_logger(), base_s=0.001)
    with capture_logs() as logs:
        await asyncio.wait_for(Feeder(redis, RUN, plan, enqueue).run_until(
            asyncio.Event(), 0.01, rider), 10)
    assert not refusals and enqueued == [0, 1, 2, 3, 4]
    assert int(await redis.hget(state_key(RUN), ADMITTED_FIELD)) == 5
    outage = [line for line in logs if line["event"].startswith("redis_outage")]
    assert [line["event"] for line in outage] == ["redis_outage_started", "redis_outage_ended"]
    assert "OOM" in outage[0]["error"]
