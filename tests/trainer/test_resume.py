"""Checkpoint and resume: kill the trainer mid-run, resume from its checkpoint, and every
group id is trained into the final model exactly once."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis.asyncio as aioredis

from rollq.consumers.trainer import ResumeError, TrainerClient
from rollq.schemas import BrokerUnavailable
from rollq.schemas.keys import stream_key
from tests.factories import make_group
from tests.trainer.helpers import RUN, client, counter, publish_many, publish_scored


async def train(tc: TrainerClient, steps: int | None, groups: int = 3) -> list[str]:
    """Run ``steps`` acked training steps (None: until the stream is drained)."""
    trained: list[str] = []
    while steps is None or steps > 0:
        batch = await tc.next_batch(groups=groups, timeout_s=None if steps else 0.3)
        if not len(batch):
            break
        trained += batch.group_ids
        await batch.ack()
        steps = None if steps is None else steps - 1
    return trained


def checkpoint(tc: TrainerClient) -> dict[str, Any]:
    saved: dict[str, Any] = json.loads(json.dumps(tc.state()))  # what a checkpoint holds
    return saved


@pytest.mark.parametrize("resume_as", ["rank0", "rank1"])
async def test_crash_and_resume_trains_every_group_exactly_once(
    real_redis: aioredis.Redis, resume_as: str
) -> None:
    ids = await publish_many(real_redis, 24, partitions=2)
    async with client(real_redis, "rank0") as tc:
        model = await train(tc, 3)  # trained into the checkpoint
        saved = checkpoint(tc)
        await train(tc, 2)  # acked, but lost with the crash: the model rolls back
        await tc.next_batch(groups=3)  # in progress when the trainer dies
        await publish_scored(real_redis, make_group(group_id="g001", seed=50), partitions=2)

    async with client(real_redis, resume_as, reclaim_idle_ms=1) as tc:
        assert await tc.load_state(saved) == 6  # the two lost steps
        model += await train(tc, None)

    assert sorted(model) == ids and len(model) == len(set(model))
    assert await counter(real_redis, "consumed", 2) == 24  # admission counts stay exact
    assert await counter(real_redis, "drop:duplicate", 2) == 1


async def test_crash_during_replay_and_checkpoint_mid_replay(redis: aioredis.Redis) -> None:
    ids = await publish_many(redis, 18)
    async with client(redis) as tc:
        model = await train(tc, 2)
        first = checkpoint(tc)
        await train(tc, 3)  # lost
    async with client(redis) as tc:  # resumes, replays one step, crashes again
        assert await tc.load_state(first) == 9
        await train(tc, 1)
    async with client(redis) as tc:  # resumes from the same checkpoint once more
        assert await tc.load_state(first) == 9
        model += await train(tc, 1)
        second = checkpoint(tc)  # taken while 6 groups still wait for replay
        assert len(second["replay"]) == 6
        await train(tc, 2)  # lost
    async with client(redis) as tc:
        assert await tc.load_state(second) == 6
        model += await train(tc, None)
    assert sorted(model) == ids and len(model) == len(set(model))
    assert await counter(redis, "consumed") == 18


async def test_crash_between_recording_and_acking(redis: aioredis.Redis) -> None:
    ids = await publish_many(redis, 6)
    async with client(redis, redis_give_up_s=0) as tc:  # the outage is not ridden out
        model = await train(tc, 1)
        saved = checkpoint(tc)
        batch = await tc.next_batch(groups=3)

        async def broken(*args: object, **kwargs: object) -> int:
            raise BrokerUnavailable("redis went away")

        tc.reader.ack_counted = broken  # type: ignore[method-assign]
        with pytest.raises(BrokerUnavailable):
            await batch.ack()  # recorded as trained, but never acked

    # Resuming from before the step: the step is replayed once, and its ack completes.
    async with client(redis) as tc:
        assert await tc.load_state(saved) == 3
        replayed = model + await train(tc, None)
    assert sorted(replayed) == ids and len(replayed) == len(set(replayed))
    assert await counter(redis, "consumed") == 6


async def test_state_after_a_recorded_step_only_finishes_its_ack(redis: aioredis.Redis) -> None:
    ids = await publish_many(redis, 6)
    async with client(redis, redis_give_up_s=0) as tc:  # the outage is not ridden out
        model = await train(tc, 1)
        batch = await tc.next_batch(groups=3)
        model += batch.group_ids

        async def broken(*args: object, **kwargs: object) -> int:
            raise BrokerUnavailable("redis went away")

        tc.reader.ack_counted = broken  # type: ignore[method-assign]
        with pytest.raises(BrokerUnavailable):
            await batch.ack()
        saved = checkpoint(tc)  # the step is in the weights and in the log
    async with client(redis) as tc:
        assert await tc.load_state(saved) == 0
        model += await train(tc, None)  # the pending entries are acked, not retrained
    assert sorted(model) == ids and len(model) == len(set(model))
    assert await counter(redis, "consumed") == 6
    assert await counter(redis, "drop:duplicate") == 0


async def test_resume_refuses_when_replay_entries_were_trimmed(redis: aioredis.Redis) -> None:
    await publish_many(redis, 6)
    async with client(redis) as tc:
        await train(tc, 1)
        saved = checkpoint(tc)
        await train(tc, 1)
    for stream in ("traj", "scored"):  # either loses the groups to replay
        await redis.xtrim(stream_key("test", 0, stream), maxlen=0)
        async with client(redis) as tc:
            with pytest.raises(ResumeError, match=f"trimmed from the {stream} streams"):
                await tc.load_state(saved)


async def test_resume_refuses_a_trimmed_log_or_a_foreign_state(redis: aioredis.Redis) -> None:
    await publish_many(redis, 6)
    async with client(redis) as tc:
        await train(tc, 1)
        saved = checkpoint(tc)
    async with client(redis, "other") as tc:
        with pytest.raises(ResumeError, match="is for run"):
            await tc.load_state({**saved, "run": "elsewhere"})
        with pytest.raises(ResumeError, match="malformed"):
            await tc.load_state({"format": 1, "run": "test"})
        # a damaged replay list: ids Redis cannot parse, another run's stream
        scored = stream_key(RUN, 0, "scored")
        for stream, entry_id in [(scored, "99999999999999999999999-0"), (scored, "1-x"),
                                 (stream_key("elsewhere", 0, "scored"), "1-0")]:
            with pytest.raises(ResumeError, match="are not entries of run 'test'"):
                await tc.load_state({**saved, "replay": [[stream, entry_id, "g000"]]})
    await redis.delete("rollq:{test}:trainer:log:rank0")
    async with client(redis) as tc:
        with pytest.raises(ResumeError, match="no longer holds"):
            await tc.load_state(saved)
    async with client(redis) as tc:
        await tc.next_batch(groups=1)
        with pytest.raises(ResumeError, match="before the first next_batch"):
            await tc.load_state(saved)
