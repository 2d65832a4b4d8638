"""TrainerClient delivery: batching, acking, duplicates, staleness, restarts, reclaim.

Tests taking ``redis`` run on fakeredis and on a real redis-server; ``real_redis`` ones
need real idle times (XAUTOCLAIM).
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from rollq.schemas import decode_dead
from rollq.schemas.keys import POLICY_VERSION_FIELD, state_key, stream_key
from rollq.schemas.runs import register_run
from tests.factories import make_group
from tests.trainer.helpers import RUN, client, counter, publish_many, publish_scored


async def test_batches_by_group_count_keep_groups_whole(redis: aioredis.Redis) -> None:
    ids = await publish_many(redis, 5, group_size=3)
    async with client(redis) as tc:
        first = await tc.next_batch(groups=2)
        second = await tc.next_batch(groups=2)
        rest = await tc.next_batch(groups=2, timeout_s=0.2)
    assert first.group_ids + second.group_ids + rest.group_ids == ids
    assert first.num_sequences == 6 and list(first.group_index) == [0, 0, 0, 1, 1, 1]
    assert len(rest) == 1  # the timeout returns a partial batch


async def test_default_batch_size_comes_from_settings(redis: aioredis.Redis) -> None:
    await publish_many(redis, 4)
    async with client(redis, batch_groups=3) as tc:
        assert len(await tc.next_batch()) == 3


async def test_batches_by_token_budget_and_sequences(redis: aioredis.Redis) -> None:
    # Each group: 2 sequences of 5 prompt + 8 completion tokens = 26 tokens.
    await publish_many(redis, 6, group_size=2, tokens=8)
    async with client(redis) as tc:
        assert len(await tc.next_batch(max_tokens=60)) == 2  # a third would make 78
        assert len(await tc.next_batch(max_tokens=10)) == 1  # at least one group
        batch = await tc.next_batch(sequences=5)  # a third group would make 6 sequences
        assert len(batch) == 2 and batch.num_tokens == 52
        assert len(await tc.next_batch(max_tokens=1000, timeout_s=0.2)) == 1


async def test_the_trainer_says_whether_it_started_the_run(redis: aioredis.Redis) -> None:
    """A trainer may start before any other role (it registers the run), but a typo in the
    run's name must not pass unseen: its start line says it created the run."""
    with capture_logs() as logs:
        async with client(redis, consumer="a"):
            pass
        async with client(redis, consumer="b"):
            pass
    started = [(e["consumer"], e["new_run"]) for e in logs if e["event"] == "trainer_started"]
    assert started == [("a", True), ("b", False)]
    # first writer wins: a later registration with another partition count gets the first's
    assert await register_run(redis, RUN, 4) == (1, False)


async def test_empty_batch_after_timeout(redis: aioredis.Redis) -> None:
    async with client(redis) as tc:
        batch = await tc.next_batch(groups=4, timeout_s=0)
    assert len(batch) == 0 and batch.input_ids.shape == (0, 0)


async def test_next_batch_waits_for_enough_groups(redis: aioredis.Redis) -> None:
    await publish_many(redis, 1)
    async with client(redis) as tc:
        waiting = asyncio.create_task(tc.next_batch(groups=2))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await publish_scored(redis, make_group(group_id="late"))
        batch = await asyncio.wait_for(waiting, 5)
    assert batch.group_ids == ["g000", "late"]


async def test_reads_every_partition(redis: aioredis.Redis) -> None:
    ids = await publish_many(redis, 12, partitions=3)
    async with client(redis) as tc:
        assert tc.partitions == 3
        batch = await tc.next_batch(groups=12)
    assert sorted(batch.group_ids) == ids
    assert len({e.stream for e in batch.entries}) == 3


async def test_ack_counts_consumed_exactly_once(redis: aioredis.Redis) -> None:
    await publish_many(redis, 3)
    async with client(redis) as tc:
        batch = await tc.next_batch(groups=3)
        assert await counter(redis, "consumed") == 0  # nothing counted before the ack
        assert await batch.ack() == 3
        assert await batch.ack() == 0  # a second ack changes nothing
    assert await counter(redis, "consumed") == 3
    pending = await redis.xpending(stream_key(RUN, 0, "scored"), "trainer")
    assert pending["pending"] == 0


async def test_duplicate_group_ids_are_dropped_and_counted(redis: aioredis.Redis) -> None:
    await publish_many(redis, 2)
    async with client(redis) as tc:
        batch = await tc.next_batch(groups=2)
        # A re-run of a job republishes g000 while the first copy is still in training,
        # and g001 again after it was trained.
        await publish_scored(redis, make_group(group_id="g000", seed=7))
        await batch.ack()
        await publish_scored(redis, make_group(group_id="g001", seed=8))
        await publish_scored(redis, make_group(group_id="fresh"))
        nxt = await tc.next_batch(groups=3, timeout_s=0.3)
    assert nxt.group_ids == ["fresh"]
    assert await counter(redis, "drop:duplicate") == 2
    assert await counter(redis, "consumed") == 2


async def test_duplicates_are_dropped_across_clients(redis: aioredis.Redis) -> None:
    await publish_many(redis, 1)
    async with client(redis, "a") as tc:
        await (await tc.next_batch(groups=1)).ack()
    await publish_scored(redis, make_group(group_id="g000"))
    async with client(redis, "b") as tc:
        assert len(await tc.next_batch(groups=1, timeout_s=0.2)) == 0
    assert await counter(redis, "drop:duplicate") == 1


async def test_stale_groups_are_rejected_and_counted(redis: aioredis.Redis) -> None:
    await redis.hset(state_key(RUN), POLICY_VERSION_FIELD, "5")
    for version in (3, 4, 5, 6):
        await publish_scored(redis, make_group(group_id=f"v{version}", policy_version=version))
    async with client(redis, max_staleness=1) as tc:
        batch = await tc.next_batch(groups=3)
    assert batch.group_ids == ["v4", "v5", "v6"]
    assert await counter(redis, "drop:stale") == 1


async def test_staleness_follows_the_clients_own_published_version(
    redis: aioredis.Redis,
) -> None:
    for version in (7, 8, 9):
        await publish_scored(redis, make_group(group_id=f"v{version}", policy_version=version))
    async with client(redis, max_staleness=1) as tc:
        await tc.publish_policy(10, "/weights/step-10")  # no servers: bumps the version only
        assert await tc.current_version() == 10
        batch = await tc.next_batch(groups=3, timeout_s=0.2)
    assert batch.group_ids == ["v9"]
    assert await counter(redis, "drop:stale") == 2


async def test_undecodable_entries_are_dead_lettered(redis: aioredis.Redis) -> None:
    await redis.hset(state_key(RUN), "partitions", "1")
    await redis.xadd(stream_key(RUN, 0, "scored"), {"v": "1", "kind": "scored"})
    await redis.xadd(stream_key(RUN, 0, "scored"), {"v": "99", "kind": "scored"})
    await publish_many(redis, 1)
    async with client(redis) as tc:
        batch = await tc.next_batch(groups=1)
    assert batch.group_ids == ["g000"]
    assert await counter(redis, "drop:decode_error") == 1
    assert await counter(redis, "drop:unknown_version_error") == 1
    assert await redis.xlen(stream_key(RUN, 0, "dead")) == 2


async def test_scored_entries_are_joined_with_their_trajectory(redis: aioredis.Redis) -> None:
    """The scored stream holds only scores and a traj entry id; the client reads the token
    arrays from that traj entry. One whose traj entry is gone is dead-lettered, never lost
    silently, and one naming another group's trajectory too."""
    group = make_group(group_id="kept", tokens=5)
    await publish_scored(redis, group)
    await publish_scored(redis, make_group(group_id="orphan"))
    await publish_scored(redis, make_group(group_id="mixed-up"))
    traj = await redis.xrange(stream_key(RUN, 0, "traj"))
    await redis.xdel(stream_key(RUN, 0, "traj"), traj[1][0])
    scored = await redis.xrange(stream_key(RUN, 0, "scored"))
    assert all(b"completion_ids" not in fields for _, fields in scored)
    await redis.xadd(stream_key(RUN, 0, "scored"), {  # names the first group's trajectory
        **scored[2][1], b"traj": traj[0][0]})
    async with client(redis) as tc:
        batch = await tc.next_batch(groups=3, timeout_s=0.5)
    assert batch.group_ids == ["kept", "mixed-up"]
    assert batch.groups[0].trajectory.completions[0].completion_ids.tolist() == \
        group.completions[0].completion_ids.tolist()
    assert await counter(redis, "drop:trajectory_missing") == 2
    dead = [decode_dead(f) for _, f in await redis.xrange(stream_key(RUN, 0, "dead"))]
    assert [d.payload[b"group_id"] for d in dead] == [b"orphan", b"mixed-up"]
    assert "is gone" in dead[0].detail and "does not hold this group" in dead[1].detail


async def test_restart_takes_back_own_pending_first(redis: aioredis.Redis) -> None:
    await publish_many(redis, 4)
    async with client(redis) as tc:
        unacked = await tc.next_batch(groups=2)  # the trainer dies before acking
    await publish_many(redis, 2, prefix="new")
    async with client(redis) as tc:
        again = await tc.next_batch(groups=2)
        await again.ack()
        rest = await tc.next_batch(groups=4)
    assert again.group_ids == unacked.group_ids
    assert rest.group_ids == ["g002", "g003", "new000", "new001"]
    assert await counter(redis, "consumed") == 2


async def test_abandoned_entries_are_reclaimed_by_another_trainer(
    real_redis: aioredis.Redis,
) -> None:
    await publish_many(real_redis, 3)
    async with client(real_redis, "dead-rank") as tc:
        lost = await tc.next_batch(groups=2)
    await asyncio.sleep(0.25)
    async with client(real_redis, "rank1", reclaim_idle_ms=200) as tc:
        taken = await tc.next_batch(groups=2)
        await taken.ack()
        rest = await tc.next_batch(groups=1)
    assert taken.group_ids == lost.group_ids and rest.group_ids == ["g002"]
    assert await counter(real_redis, "consumed") == 2


async def test_invalid_names_are_refused(redis: aioredis.Redis) -> None:
    with pytest.raises(ValueError, match="consumer name"):
        client(redis, "rank{0}")
