"""The seen-set is bounded by the dedup window, and still drops every copy that can arrive
within it: across reads, across trainer restarts."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from rollq.consumers.trainer import TrainerClient, TrainerClientSettings
from rollq.consumers.trainer.ledger import SEEN_BUCKETS
from tests.factories import make_group
from tests.trainer.helpers import RUN, counter, publish_scored


def client(redis: aioredis.Redis, window_s: float) -> TrainerClient:
    return TrainerClient(redis, run=RUN, consumer="rank0", settings=TrainerClientSettings(
        block_ms=50, reclaim_every_s=3600.0, dedup_window_s=window_s))


async def seen_sizes(redis: aioredis.Redis) -> list[int]:
    keys = await redis.keys(f"rollq:{{{RUN}}}:trainer:seen:*")
    return [int(await redis.hlen(k)) for k in keys]


@pytest.mark.slow
async def test_copies_within_the_window_are_dropped_and_old_records_expire(
        real_redis: aioredis.Redis) -> None:
    groups = [make_group(run=RUN, group_id=f"g{i}", seed=i) for i in range(30)]
    for group in groups:
        await publish_scored(real_redis, group)
    async with client(real_redis, window_s=2.0) as trainer:
        batch = await trainer.next_batch(groups=30, timeout_s=5)
        await trainer.ack(batch)
    assert sum(await seen_sizes(real_redis)) == 30
    assert len(await seen_sizes(real_redis)) <= SEEN_BUCKETS + 2
    ttls = [await real_redis.ttl(k) for k in
            await real_redis.keys(f"rollq:{{{RUN}}}:trainer:seen:*")]
    assert all(0 < ttl <= 5 for ttl in ttls)  # window + two buckets (1 s at least)

    # A re-run published copies of five of them: a restarted trainer drops all five.
    for group in groups[:5]:
        await publish_scored(real_redis, group)
    async with client(real_redis, window_s=2.0) as trainer:
        again = await trainer.next_batch(groups=5, timeout_s=1)
    assert again.group_ids == []
    assert await counter(real_redis, "drop:duplicate") == 5

    await asyncio.sleep(5.5)  # past the window: the records are gone, nothing grows
    assert await seen_sizes(real_redis) == []
