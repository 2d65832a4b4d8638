"""Prefetch: the batch after the one handed out is read, checked, decoded and laid out while
the caller trains, and nothing about delivery changes (acks, staleness, dead letters,
outages, resume).

"While the caller trains" is a wait on what the client or Redis shows (the next batch's
entries pending for this consumer, the prefetch finished), never a sleep of a guessed
length.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from rollq.consumers.trainer import SyncTrainerClient, TrainerClient
from rollq.schemas import decode_dead
from rollq.schemas.keys import stream_key
from tests.factories import make_group
from tests.redis_server import RedisServer
from tests.trainer.helpers import FAST, RUN, client, counter, publish_many, publish_scored
from tests.trainer.test_poison import POISON, poisoned, publish_raw
from tests.waiting import until

SCORED = stream_key(RUN, 0, "scored")
DEAD = stream_key(RUN, 0, "dead")


async def pending(redis: aioredis.Redis) -> dict[str, int]:
    """Entry id -> times delivered, of every entry pending in the trainer group, in order."""
    rows = await redis.xpending_range(SCORED, "trainer", min="-", max="+", count=1000)
    return {row["message_id"].decode(): int(row["times_delivered"]) for row in rows}


def prepared(tc: TrainerClient) -> bool:
    """Whether the client's prefetch has finished (white box: no Redis reply shows it)."""
    return tc._prefetcher.finished


def queued(tc: TrainerClient) -> list[str]:
    return [h.group.group_id for h in tc._books.queue]


def refuse_reads(tc: TrainerClient) -> None:
    """Make any further read of entries (new, reclaimed, own pending) fail the test."""

    async def refused(*args: object, **kwargs: object) -> Any:
        raise AssertionError("next_batch read entries from Redis")

    for verb in ("read", "reclaim", "read_own_pending", "recover_own_pending"):
        setattr(tc.reader, verb, refused)


async def test_the_next_batch_is_prepared_while_the_caller_trains(
    redis: aioredis.Redis,
) -> None:
    ids = await publish_many(redis, 6)
    async with client(redis) as tc:
        first = await tc.next_batch(groups=3)
        # the caller "trains": meanwhile the next three entries are read, held, laid out
        await until(lambda: prepared(tc), "the next batch to be prepared")
        assert list((await pending(redis)).values()) == [1] * 6
        assert queued(tc) == ids[3:]
        await first.ack()
        refuse_reads(tc)
        second = await tc.next_batch(groups=3)
        assert second.group_ids == ids[3:] and second.num_sequences == 12
        await second.ack()
    assert await counter(redis, "consumed") == 6


async def test_the_wait_recorded_is_what_the_caller_blocked_on(redis: aioredis.Redis) -> None:
    """A call that waits for the prefetch (the stream ran dry) records that wait: the
    metric and the bench see the caller's wait, not the task's last bit of work."""
    await publish_many(redis, 2)
    async with client(redis) as tc:
        await tc.next_batch(groups=2)
        before = tc.stats.wait_seconds.sum
        waiting = asyncio.create_task(tc.next_batch(groups=2))
        started = time.monotonic()
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await publish_many(redis, 2, prefix="late")
        batch = await asyncio.wait_for(waiting, 10)
        blocked = time.monotonic() - started
    assert batch.group_ids == ["late000", "late001"]
    assert 0.3 <= tc.stats.wait_seconds.sum - before <= blocked


async def test_nothing_is_acked_early_and_a_crash_gives_every_entry_back_once(
    redis: aioredis.Redis,
) -> None:
    ids = await publish_many(redis, 6)
    async with client(redis) as tc:
        first = await tc.next_batch(groups=3)
        await until(lambda: prepared(tc), "the next batch to be prepared")
        assert list((await pending(redis)).values()) == [1] * 6  # both batches, unacked
        assert await counter(redis, "consumed") == 0
        assert first.group_ids == ids[:3]
    # the trainer died before acking: a new one with the same consumer name
    async with client(redis) as tc:
        again = [await tc.next_batch(groups=3), await tc.next_batch(groups=3)]
        assert list((await pending(redis)).values()) == [2] * 6  # re-read once, each
        for batch in again:
            await batch.ack()
        assert len(await tc.next_batch(groups=3, timeout_s=0.2)) == 0
    assert again[0].group_ids + again[1].group_ids == ids  # every entry once, in order
    assert await pending(redis) == {}
    assert await counter(redis, "consumed") == 6
    assert await counter(redis, "drop:duplicate") == 0
    assert await redis.xlen(DEAD) == 0


async def test_staleness_is_judged_when_the_batch_is_handed_out(redis: aioredis.Redis) -> None:
    """The groups prepared at version 0 are stale once version 2 is published during the
    step: they are dropped as stale, and the batch handed out is full of fresh ones."""
    old = await publish_many(redis, 6, policy_version=0)
    async with client(redis, max_staleness=1) as tc:
        first = await tc.next_batch(groups=3)
        await until(lambda: prepared(tc), "the next batch to be prepared")
        assert queued(tc) == old[3:]
        await first.ack()
        await tc.publish_policy(2, "/weights/step-2")  # no servers: bumps the version only
        fresh = await publish_many(redis, 3, prefix="fresh", policy_version=2)
        second = await tc.next_batch(groups=3)
        assert tc.stats.staleness.count == 3
        await second.ack()
    assert second.group_ids == fresh
    assert await counter(redis, "drop:stale") == 3
    assert await counter(redis, "consumed") == 6
    assert await pending(redis) == {}


async def test_a_version_bump_that_leaves_the_batch_fresh_hands_it_out(
    redis: aioredis.Redis,
) -> None:
    ids = await publish_many(redis, 6, policy_version=1)
    async with client(redis, max_staleness=1) as tc:
        await tc.next_batch(groups=3)
        await until(lambda: prepared(tc), "the next batch to be prepared")
        await tc.publish_policy(2, "/weights/step-2")  # version 1 is still fresh at 2
        refuse_reads(tc)
        second = await tc.next_batch(groups=3)
    assert second.group_ids == ids[3:]
    assert await counter(redis, "drop:stale") == 0


@pytest.mark.parametrize("when", ["prepared", "still_reading"])
async def test_other_sizes_leave_the_prepared_groups_first_in_line(
    redis: aioredis.Redis, when: str
) -> None:
    """Asked for other sizes, the client discards the prepared batch (or stops preparing
    it): its groups are the next in line, none lost, none repeated, order kept."""
    ids = await publish_many(redis, 8 if when == "prepared" else 3)
    async with client(redis) as tc:
        first = await tc.next_batch(groups=2)
        if when == "prepared":
            await until(lambda: prepared(tc), "the next batch to be prepared")
        else:  # one group read, the prefetch polls for the second
            await until(lambda: queued(tc) == ids[2:], "the next group to be read")
            assert not prepared(tc)
        second = await tc.next_batch(groups=3, timeout_s=None if when == "prepared" else 0.3)
        third = await tc.next_batch(sequences=12, timeout_s=0.3)  # 3 groups of 4
        for batch in (first, second, third):
            await batch.ack()
        tail = await tc.next_batch(groups=3, timeout_s=0.2)
    trained = first.group_ids + second.group_ids + third.group_ids + tail.group_ids
    assert trained == ids
    assert await counter(redis, "consumed") == len(ids)
    assert await pending(redis) == {}


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "without"])
async def test_poison_met_while_prefetching_is_dead_lettered_as_without_prefetch(
    redis: aioredis.Redis, layout_breaks_on: set[str], prefetch: bool
) -> None:
    """Poison that arrives during the step (one entry that does not decode, one that
    cannot be laid out): the same dead letters, reasons and counters with prefetch as
    without it, and the next batch is still full."""
    layout_breaks_on.add("poison-layout")
    ids = await publish_many(redis, 3)
    async with client(redis, prefetch=prefetch) as tc:
        first = await tc.next_batch(groups=3)
        for name in ("poison-nan", "poison-layout"):
            await publish_raw(redis, poisoned(name), POISON[name][0])
            await publish_scored(redis, make_group(group_id=f"after-{name}", seed=9))
        await publish_scored(redis, make_group(group_id="last", seed=10))
        if prefetch:  # both dead-lettered during the step, before the next call
            await until(lambda: prepared(tc), "the next batch to be prepared")
            assert await redis.xlen(DEAD) == 2
        await first.ack()
        second = await tc.next_batch(groups=3)
        await second.ack()
    assert first.group_ids == ids
    assert second.group_ids == ["after-poison-nan", "after-poison-layout", "last"]
    for array in (second.advantages, second.sampler_logprobs, second.rewards):
        assert np.isfinite(array).all()
    letters = [decode_dead(f) for _, f in await redis.xrange(DEAD)]
    assert [(x.payload[b"group_id"], x.reason, x.deliveries) for x in letters] == [
        (b"poison-nan", "decode_error", 1), (b"poison-layout", "unexpected_error", 1)]
    assert await counter(redis, "drop:decode_error") == 1
    assert await counter(redis, "drop:unexpected_error") == 1
    assert await counter(redis, "consumed") == 6
    assert await pending(redis) == {}


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "without"])
@pytest.mark.parametrize("when", ["prepared", "still_reading"])
@pytest.mark.parametrize("outage", ["within_the_step", "into_the_call"])
async def test_a_redis_outage_during_the_step_ends_as_without_prefetch(
    make_redis_server: type, prefetch: bool, when: str, outage: str
) -> None:
    """Redis goes away while the caller trains, after the next batch was prepared or while
    the prefetch still waits for it, and is back before the next call or only during it:
    the same log lines as without prefetch (none, or the outage ridden out by the call),
    the same batches, and no entry counts a delivery more."""
    server = make_redis_server(appendonly=True).start()
    redis = aioredis.Redis.from_url(server.url)
    ids = await publish_many(redis, 6 if when == "prepared" else 3)
    with capture_logs() as logs:
        async with client(redis, prefetch=prefetch, redis_give_up_s=30) as tc:
            first = await tc.next_batch(groups=3)
            if prefetch and when == "prepared":
                await until(lambda: prepared(tc), "the next batch to be prepared")
            elif prefetch:
                await asyncio.sleep(0.2)  # a few polls of the dry stream
                assert not prepared(tc)
            await asyncio.to_thread(server.stop)
            await asyncio.sleep(0.2)
            if outage == "within_the_step":
                await asyncio.to_thread(server.start)
            waiting = asyncio.create_task(tc.next_batch(groups=3, timeout_s=30))
            if outage == "into_the_call":
                await until(lambda: "redis_outage_started" in [e["event"] for e in logs],
                            "the call to meet the outage")
                await asyncio.to_thread(server.start)
            publisher = aioredis.Redis.from_url(server.url)
            if when == "still_reading":
                ids += await publish_many(publisher, 3, prefix="late")
            second = await asyncio.wait_for(waiting, 60)
            delivered = await pending(publisher)
            await first.ack()
            await second.ack()
    assert first.group_ids + second.group_ids == ids
    assert [delivered[e.entry_id] for e in second.entries] == [1] * 3
    events = [e["event"] for e in logs if e["event"].startswith("redis_outage")]
    assert events == ([] if outage == "within_the_step" else
                      ["redis_outage_started", "redis_outage_ended"])
    assert await counter(publisher, "consumed") == 6
    assert await pending(publisher) == {}
    assert await publisher.xlen(DEAD) == 0
    for connection in (redis, publisher):
        await connection.aclose()


async def test_an_error_met_while_prefetching_is_raised_by_the_next_call(
    redis: aioredis.Redis,
) -> None:
    await publish_many(redis, 9)
    async with client(redis) as tc:
        first = await tc.next_batch(groups=3)
        lookup = tc._ledger.seen

        async def broken(*args: object, **kwargs: object) -> Any:
            raise RuntimeError("a bug in the dedup lookup")

        tc._ledger.seen = broken  # type: ignore[method-assign]
        await until(lambda: prepared(tc), "the prefetch to fail")
        await first.ack()  # ack is unaffected
        with pytest.raises(RuntimeError, match="a bug in the dedup lookup"):
            await tc.next_batch(groups=3)
        tc._ledger.seen = lookup  # type: ignore[method-assign]
    with capture_logs() as logs:  # an error no call collects is logged at close
        async with client(redis) as tc:
            await tc.next_batch(groups=3)  # what the first left pending; then new entries
            tc._ledger.seen = broken  # type: ignore[method-assign]
            await until(lambda: prepared(tc), "the prefetch to fail")
    (failed,) = [e for e in logs if e["event"] == "batch_prefetch_failed"]
    assert "a bug in the dedup lookup" in failed["error"]


def checkpoint(tc: TrainerClient) -> dict[str, Any]:
    saved: dict[str, Any] = json.loads(json.dumps(tc.state()))
    return saved


async def test_resume_with_a_prefetched_batch_outstanding_neither_skips_nor_repeats(
    redis: aioredis.Redis,
) -> None:
    """Checkpoints taken while a prepared batch waits (of new groups, then of groups to
    replay): it is not trained, so the state neither records it nor drops it from the
    replay list; every group is trained into the final model exactly once."""
    ids = await publish_many(redis, 18)
    async with client(redis) as tc:
        model = (batch := await tc.next_batch(groups=3)).group_ids
        await batch.ack()
        await until(lambda: prepared(tc), "the next batch to be prepared")
        first = checkpoint(tc)
        assert first["replay"] == []
        for _ in range(3):  # acked but lost with the crash (the first one was prefetched)
            await (await tc.next_batch(groups=3)).ack()
        await tc.next_batch(groups=3)  # in the step when the trainer dies
    async with client(redis) as tc:
        assert await tc.load_state(first) == 9
        batch = await tc.next_batch(groups=3)  # replays; the next 3 replays are prefetched
        model += batch.group_ids
        await batch.ack()
        await until(lambda: prepared(tc), "the next batch to be prepared")
        second = checkpoint(tc)
        assert len(second["replay"]) == 6  # the prefetched replays are still to replay
        await (await tc.next_batch(groups=3)).ack()  # lost with the second crash
    async with client(redis) as tc:
        assert await tc.load_state(second) == 6
        while len(batch := await tc.next_batch(groups=3, timeout_s=0.3)):
            model += batch.group_ids
            await batch.ack()
    assert sorted(model) == ids and len(model) == len(set(model))
    assert await counter(redis, "consumed") == 18
    assert await counter(redis, "drop:duplicate") == 0
    assert await pending(redis) == {}


async def test_replayed_groups_are_never_stale_checked_at_hand_out(
    redis: aioredis.Redis,
) -> None:
    ids = await publish_many(redis, 6, policy_version=0)
    async with client(redis, max_staleness=0) as tc:
        saved = checkpoint(tc)
        for _ in range(2):
            await (await tc.next_batch(groups=3)).ack()  # lost with the crash
    async with client(redis, max_staleness=0) as tc:
        assert await tc.load_state(saved) == 6
        first = await tc.next_batch(groups=3)
        await until(lambda: prepared(tc), "the next batch to be prepared")
        await tc.publish_policy(5, "/weights/step-5")  # every group is 5 versions old
        with capture_logs() as logs:
            second = await tc.next_batch(groups=3)
    assert first.group_ids + second.group_ids == ids
    assert not [e for e in logs if e["event"] == "batch_prefetch_discarded"]  # handed out
    assert await counter(redis, "drop:stale") == 0


def test_the_sync_facade_prefetches_while_the_caller_sleeps(
    redis_server: RedisServer,
) -> None:
    """Through the sync facade the prefetch runs on the client's loop thread while the
    caller's step (here a sleep, which releases the GIL as a GPU step does) runs."""
    plain = sync_redis.Redis.from_url(redis_server.url)
    plain.flushall()

    async def publish() -> list[str]:
        async with aioredis.Redis.from_url(redis_server.url) as redis:
            return await publish_many(redis, 6)

    ids = asyncio.run(publish())
    with SyncTrainerClient(redis_server.url, run=RUN, consumer="rank0",
                           settings=FAST) as tc:
        first = tc.next_batch(groups=3)
        deadline = time.monotonic() + 60
        while not prepared(tc.client):  # the caller's step
            assert time.monotonic() < deadline, "the next batch was not prepared"
            time.sleep(0.01)
        first.ack()
        assert tc.state()["replay"] == []
        refuse_reads(tc.client)
        second = tc.next_batch(groups=3)
        second.ack()
    assert first.group_ids + second.group_ids == ids
    assert plain.xpending(SCORED, "trainer")["pending"] == 0
    plain.close()
