"""A scorer rides out Redis restarts (graceful and kill -9) and forwards every group once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from rollq.ops.roles import run_scorer
from rollq.ops.settings import ScorerSettings
from rollq.producers.publisher import Publisher
from rollq.schemas.keys import stream_key
from tests.factories import make_group
from tests.waiting import until

RUN = "outage"
QUICK = ("components:\n  - name: length\n    component: length_bounty\n"
         "advantages: {zero_variance: keep}\n")


@pytest.mark.slow
@pytest.mark.parametrize("kill", [False, True], ids=["shutdown", "kill-9"])
async def test_scorer_rides_out_redis_restarts(make_redis_server: type, tmp_path: Path,
                                               kill: bool) -> None:
    server = make_redis_server(appendonly=True).start()
    config = tmp_path / "quick.yaml"
    config.write_text(QUICK)
    redis = aioredis.Redis.from_url(server.url)
    publisher = Publisher(redis, RUN)
    scored = stream_key(RUN, 0, "scored")
    settings = ScorerSettings(redis_url=server.url, run=RUN, reward_config=config,
                              block_ms=200, redis_give_up_s=30)
    stop = asyncio.Event()
    with capture_logs() as logs:
        task = asyncio.create_task(run_scorer(settings, stop))
        for i in range(10):
            await publisher.publish(make_group(run=RUN, group_id=f"before{i}"))
        await until(lambda: _length(redis, scored, 10))
        for _ in range(2):  # two outages in a row, the second while groups wait
            await asyncio.to_thread(server.restart, kill=kill)
            for i in range(10):
                await publisher.publish(make_group(run=RUN, group_id=f"after{_}-{i}"))
        await until(lambda: _length(redis, scored, 30))
        stop.set()
        await asyncio.wait_for(task, 30)
    assert not task.exception()
    events = [entry["event"] for entry in logs]
    assert events.count("redis_outage_started") == events.count("redis_outage_ended") >= 1
    assert "redis_outage_gave_up" not in events
    assert (await redis.xpending(stream_key(RUN, 0, "traj"), "scorers"))["pending"] == 0
    await redis.aclose()


async def _length(redis: aioredis.Redis, key: str, expected: int) -> bool:
    length = int(await redis.xlen(key))
    assert length <= expected, f"{key} holds {length} entries, more than {expected}"
    return length == expected


@pytest.mark.slow
async def test_scorer_gives_up_after_its_give_up_time(make_redis_server: type,
                                                      tmp_path: Path) -> None:
    server = make_redis_server(appendonly=True).start()
    config = tmp_path / "quick.yaml"
    config.write_text(QUICK)
    settings = ScorerSettings(redis_url=server.url, run=RUN, reward_config=config,
                              block_ms=100, redis_give_up_s=1.0)
    task = asyncio.create_task(run_scorer(settings, asyncio.Event()))
    redis = aioredis.Redis.from_url(server.url)
    await until(lambda: _groups_exist(redis))
    await redis.aclose()
    await asyncio.to_thread(server.kill)
    from rollq.schemas import BrokerUnavailable

    with pytest.raises(BrokerUnavailable):
        await asyncio.wait_for(task, 20)


async def _groups_exist(redis: aioredis.Redis) -> bool:
    try:
        return bool(await redis.xinfo_groups(stream_key(RUN, 0, "traj")))
    except aioredis.ResponseError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("kill", [False, True], ids=["shutdown", "kill-9"])
async def test_the_trainer_sdk_rides_out_redis_restarts(make_redis_server: type,
                                                        kill: bool) -> None:
    """A trainer waiting in next_batch while Redis restarts gets its batch after, and
    every group is trained once."""
    from rollq.consumers.trainer import TrainerClient, TrainerClientSettings
    from tests.trainer.helpers import publish_scored

    server = make_redis_server(appendonly=True).start()
    redis = aioredis.Redis.from_url(server.url)
    for i in range(6):
        await publish_scored(redis, make_group(run="test", group_id=f"a{i}", seed=i))
    settings = TrainerClientSettings(block_ms=100, redis_give_up_s=30)
    trained: list[str] = []
    with capture_logs() as logs:
        async with TrainerClient(redis, run="test", consumer="t0", settings=settings) as client:
            batch = await client.next_batch(groups=3, timeout_s=5)
            await asyncio.to_thread(server.restart, kill=kill)  # between a read and the ack
            await client.ack(batch)
            trained += batch.group_ids
            waiting = asyncio.create_task(client.next_batch(groups=6, timeout_s=30))
            await asyncio.sleep(0.3)
            await asyncio.to_thread(server.restart, kill=kill)  # while it waits
            for i in range(3):
                await publish_scored(redis, make_group(run="test", group_id=f"b{i}", seed=9 + i))
            batch = await asyncio.wait_for(waiting, 40)
            await client.ack(batch)
            trained += batch.group_ids
    assert sorted(trained) == sorted([f"a{i}" for i in range(6)] + [f"b{i}" for i in range(3)])
    events = [entry["event"] for entry in logs]
    assert events.count("redis_outage_ended") >= 1 and "redis_outage_gave_up" not in events
    await redis.aclose()
