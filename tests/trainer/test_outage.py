"""The trainer SDK through Redis outages: a pause, not an exception, until the give-up time.

Real redis-servers (AOF on) restarted under a running client; the half-done ack is driven
by a reader whose ack fails once, before or after its XACK went through.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from rollq.schemas import BrokerUnavailable
from rollq.schemas.keys import stream_key
from tests.trainer.helpers import RUN, client, counter, publish_many
from tests.waiting import until

SCORED = stream_key(RUN, 0, "scored")
DEAD = stream_key(RUN, 0, "dead")


def ended(logs: list[dict[str, object]]) -> int:
    return sum(entry["event"] == "redis_outage_ended" for entry in logs)


@pytest.mark.slow
@pytest.mark.parametrize("kill", [False, True], ids=["shutdown", "kill-9"])
async def test_outages_while_groups_wait_in_hand_are_not_deliveries(
    make_redis_server: type, kill: bool
) -> None:
    """Three restarts while a batch is out and next_batch waits: the client takes back
    only what it lacks, so the groups in its hands are not pushed past max_deliveries
    (re-reading them after each outage made them dead letters in the middle of a step)."""
    server = make_redis_server(appendonly=True).start()
    redis = aioredis.Redis.from_url(server.url)
    await publish_many(redis, 2)
    with capture_logs() as logs:
        # give-up 4 s < the three outages' span: each outage is timed from its own start
        async with client(redis, max_deliveries=2, redis_give_up_s=4) as tc:
            first = await tc.next_batch(groups=2, timeout_s=5)
            waiting = asyncio.create_task(tc.next_batch(groups=1, timeout_s=60))
            for outage in range(1, 4):
                await asyncio.sleep(1.5)  # next_batch is blocked in a read
                await asyncio.to_thread(server.restart, kill=kill)
                await until(lambda outage=outage: ended(logs) >= outage)
            await publish_many(redis, 1, prefix="late")
            second = await asyncio.wait_for(waiting, 60)
            assert first.group_ids == ["g000", "g001"] and second.group_ids == ["late000"]
            await first.ack()
            await second.ack()
    assert await redis.xlen(DEAD) == 0
    assert await counter(redis, "consumed") == 3
    assert (await redis.xpending(SCORED, "trainer"))["pending"] == 0
    assert not [entry for entry in logs if entry["event"] == "redis_outage_gave_up"]
    await redis.aclose()


async def test_a_read_whose_reply_was_lost_is_taken_back_after_the_outage(
    redis: aioredis.Redis,
) -> None:
    """Redis delivered entries but the reply never arrived: they are pending for this
    consumer, unknown to the client, and come back once Redis answers again."""
    await publish_many(redis, 3)
    async with client(redis, redis_give_up_s=30) as tc:
        held = await tc.next_batch(groups=1)  # started: own pending re-read done
        original = tc.reader.read
        lost = []

        async def read_then_drop_the_reply(*args: object, **kwargs: object) -> object:
            tc.reader.read = original  # type: ignore[method-assign]
            lost.extend(await original(*args, **kwargs))
            raise BrokerUnavailable("connection reset while reading the reply")

        tc.reader.read = read_then_drop_the_reply  # type: ignore[method-assign]
        batch = await tc.next_batch(groups=2, timeout_s=5)
        assert len(lost) == 2 and batch.group_ids == ["g001", "g002"]
        assert held.group_ids == ["g000"]
        await held.ack()
        await batch.ack()
    assert await redis.xlen(DEAD) == 0
    assert await counter(redis, "consumed") == 3


@pytest.mark.parametrize("cut", ["before_the_xack", "after_the_xack"])
async def test_an_ack_cut_off_half_way_is_retried_to_the_same_effect(
    redis: aioredis.Redis, cut: str
) -> None:
    """The batch is recorded, then Redis goes away before the XACK, or after it with the
    reply lost: the rider retries the whole ack, and every count stays exact."""
    ids = await publish_many(redis, 3)
    with capture_logs() as logs:
        async with client(redis, redis_give_up_s=30) as tc:
            saved = tc.state()
            batch = await tc.next_batch(groups=3)
            original = tc.reader.ack_counted

            async def fails_once(*args: object, **kwargs: object) -> int:
                tc.reader.ack_counted = original  # type: ignore[method-assign]
                if cut == "after_the_xack":
                    await original(*args, **kwargs)  # type: ignore[arg-type]
                raise BrokerUnavailable("redis went away")

            tc.reader.ack_counted = fails_once  # type: ignore[method-assign]
            await batch.ack()
    assert [e["event"] for e in logs if e["event"].startswith("redis_outage")] == [
        "redis_outage_started", "redis_outage_ended"]
    assert await counter(redis, "consumed") == 3  # not 6, not 0
    assert (await redis.xpending(SCORED, "trainer"))["pending"] == 0
    async with client(redis) as tc:  # the step is replayed once from the older state
        assert await tc.load_state(saved) == 3
        replayed = await tc.next_batch(groups=3, timeout_s=1)
        assert replayed.group_ids == ids
        await replayed.ack()
    assert await counter(redis, "consumed") == 3
    assert await counter(redis, "drop:duplicate") == 0


@pytest.mark.slow
async def test_next_batch_and_ack_give_up_after_redis_give_up_s(make_redis_server: type) -> None:
    server = make_redis_server(appendonly=True).start()
    redis = aioredis.Redis.from_url(server.url)
    await publish_many(redis, 1)
    with capture_logs() as logs:
        async with client(redis, redis_give_up_s=0.5) as tc:
            batch = await tc.next_batch(groups=1)
            await asyncio.to_thread(server.stop)
            for call in (batch.ack, lambda: tc.next_batch(groups=1, timeout_s=30)):
                started = time.monotonic()
                with pytest.raises(BrokerUnavailable):
                    await call()
                assert 0.5 <= time.monotonic() - started < 10
    events = [e["event"] for e in logs if e["event"].startswith("redis_outage")]
    assert events == ["redis_outage_started", "redis_outage_gave_up"] * 2
    await redis.aclose()
