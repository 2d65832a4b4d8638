"""``rollq dead requeue`` on a real redis-server: scoring, trainer and rollout failures go
back where they failed and are processed again by the real roles; the counters and the
admission books follow; a letter requeued twice at once is requeued once; the trainer never
trains a requeued group twice; letters too old or not from a traj or scored stream are
skipped. Listing and the command line: ``test_dead.py``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from rollq.consumers.bus import Delivery, StreamReader
from rollq.consumers.trainer import TrainerClient
from rollq.consumers.trainer.client import TRAINER_GROUP
from rollq.ops.dead import Letter, find, letters, published_at, requeue, too_old
from rollq.ops.status import collect_status, render_status
from rollq.producers.admission import outstanding
from rollq.producers.feeder import Feeder, FeedPlan
from rollq.producers.publisher import Publisher
from rollq.producers.worker import (
    close_worker,
    connect_queue,
    enqueue_rollout,
    job_id,
    queue_name,
    requeue_rollout,
)
from rollq.schemas import ContractError, DeadLetter, Fields, decode_trajectory, encode
from rollq.schemas.keys import ADMITTED_FIELD, readmit_key, state_key, stream_key
from tests.dead_helpers import NEEDS_GOLD, RUN, counters, put_letter, scorer_pass
from tests.factories import make_group, score
from tests.producers.fake_vllm import FakeVLLM
from tests.producers.test_job_failures import FlakyEnv, worker
from tests.redis_server import RedisServer
from tests.trainer.helpers import FAST

NO_GOLD = ("components:\n  - name: length\n    component: length_bounty\n"
           "advantages: {zero_variance: keep}\n")


# ------------------------------------------------------------------------------ helpers

async def in_flight(redis: aioredis.Redis) -> int:
    """``admitted − consumed − dropped``, as the feeder's admission sees it."""
    admitted = int(await redis.hget(state_key(RUN), ADMITTED_FIELD) or 0)
    return outstanding(admitted, await counters(redis))[1]


async def readmit_once(url: str, redis: aioredis.Redis) -> int:
    """One pass of a real feeder (budget 8, no new items): the requeued jobs it enqueued."""
    queue = await connect_queue(url)

    async def no_new_items(position: int) -> bool:
        raise AssertionError("the dataset is empty")

    async def requeue_job(env: str, position: int) -> bool:
        return await requeue_rollout(queue, RUN, env, position)

    feeder = Feeder(redis, RUN, FeedPlan(dataset_size=0, epochs=1, max_staleness=1,
                                         batch_groups=4), no_new_items, requeue=requeue_job)
    try:
        await feeder.feed_once()
    finally:
        await queue.aclose()
    return feeder.readmitted


async def admit(redis: aioredis.Redis, groups: int) -> None:
    await redis.hincrby(state_key(RUN), ADMITTED_FIELD, groups)


def trainer_client(redis: aioredis.Redis) -> TrainerClient:
    return TrainerClient(redis, run=RUN, consumer="rank0", settings=FAST)


async def drain(arq_worker: Any) -> None:
    try:
        await asyncio.wait_for(arq_worker.main(), 60)
    finally:
        await close_worker(arq_worker)


# ------------------------------------------------------------------------------ requeue

async def test_requeue_a_scoring_failure_after_fixing_the_config(
        real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path) -> None:
    (tmp_path / "gold.yaml").write_text(NEEDS_GOLD)
    (tmp_path / "plain.yaml").write_text(NO_GOLD)
    for i in range(3):  # no gold answer in the metadata: dead-lettered, missing field
        await Publisher(real_redis, RUN).publish(
            make_group(run=RUN, group_id=f"g{i}", metadata={"q": "?"}))
    await admit(real_redis, 3)
    await scorer_pass(redis_server.url, tmp_path / "gold.yaml")
    dead = await letters(real_redis, RUN)
    assert [d.letter.reason for d in dead] == ["reward_missing_field"] * 3
    assert (await counters(real_redis))["drop:reward_missing_field"] == 3
    assert await in_flight(real_redis) == 0  # dead letters freed their admission slots

    [chosen] = [d for d in dead if d.group_id == "g1"]
    traj_length = await real_redis.xlen(stream_key(RUN, 0, "traj"))
    [dry] = await requeue(real_redis, RUN, [chosen], dry_run=True)
    assert dry.action == "would_requeue"
    assert len(await letters(real_redis, RUN)) == 3  # the dry run changed nothing
    assert await real_redis.xlen(stream_key(RUN, 0, "traj")) == traj_length
    assert "requeued" not in await counters(real_redis)

    [done] = await requeue(real_redis, RUN, [chosen])
    assert done.action == "requeued" and stream_key(RUN, 0, "traj") in done.detail
    [(_, fields)] = await real_redis.xrange(stream_key(RUN, 0, "traj"),
                                            min=done.detail.rsplit(" ", 1)[1])
    assert fields == chosen.letter.payload  # byte for byte
    assert {d.group_id for d in await letters(real_redis, RUN)} == {"g0", "g2"}
    state = await counters(real_redis)
    assert state["drop:reward_missing_field"] == 2 and state["requeued"] == 1
    assert await in_flight(real_redis) == 1  # the admission budget counts it again

    await scorer_pass(redis_server.url, tmp_path / "plain.yaml")  # the fixed reward config
    [(_, scored)] = await real_redis.xrange(stream_key(RUN, 0, "scored"))
    assert scored[b"group_id"] == b"g1"
    assert (await counters(real_redis))["scored"] == 1
    async with trainer_client(real_redis) as trainer:
        batch = await trainer.next_batch(groups=1, timeout_s=5)
        assert batch.group_ids == ["g1"]
        await trainer.ack(batch)
    assert await in_flight(real_redis) == 0
    status = await collect_status(real_redis, RUN)
    assert status.accounting is not None and status.accounting.unaccounted == 0
    assert "requeued 1" in render_status(status)


async def test_requeue_a_trainer_failure_goes_back_to_the_scored_stream(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    await Publisher(real_redis, RUN).register()
    await admit(real_redis, 2)
    traj, scored = stream_key(RUN, 0, "traj"), stream_key(RUN, 0, "scored")
    traj_ids = {}
    for name in ("kept", "trimmed"):
        group = make_group(run=RUN, group_id=name)
        traj_ids[name] = (await real_redis.xadd(traj, encode(group))).decode()  # type: ignore[arg-type]
        await real_redis.xadd(scored, encode(score(group), trajectory_id=traj_ids[name]))  # type: ignore[arg-type]
    reader = StreamReader(real_redis, [scored], TRAINER_GROUP, "rank9")
    await reader.ensure_groups()
    deliveries = await reader.read()
    assert len(deliveries) == 2
    for delivery in deliveries:  # the trainer stage gives up on both
        assert await reader.dead_letter(delivery, "unexpected_error", "a trainer bug")
    assert await in_flight(real_redis) == 0
    by_group = {d.group_id: d for d in await letters(real_redis, RUN)}
    assert by_group["kept"].source == "scored"

    await real_redis.xdel(traj, traj_ids["trimmed"])  # its trajectory was trimmed meanwhile
    [skipped] = await requeue(real_redis, RUN, [by_group["trimmed"]])
    assert skipped.action == "skipped" and "trimmed" in skipped.detail
    assert await real_redis.xlen(scored) == 2  # the copy added in the MULTI was taken back
    assert len(await find(real_redis, RUN, by_group["trimmed"].entry_id)) == 1
    assert (await counters(real_redis))["drop:unexpected_error"] == 2

    [done] = await requeue(real_redis, RUN, [by_group["kept"]])
    assert done.action == "requeued" and scored in done.detail
    assert await in_flight(real_redis) == 1
    async with trainer_client(real_redis) as trainer:
        batch = await trainer.next_batch(groups=1, timeout_s=5)
        assert batch.group_ids == ["kept"]
        await trainer.ack(batch)
    state = await counters(real_redis)
    assert (state["consumed"], state["requeued"], state["drop:unexpected_error"]) == (1, 1, 1)
    assert await in_flight(real_redis) == 0


async def test_requeue_a_rollout_failure_runs_the_job_again(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    broken = FlakyEnv(lambda index, call: (_ for _ in ()).throw(ContractError("bad item")))
    await Publisher(real_redis, RUN).register()
    queue = await connect_queue(redis_server.url)
    await enqueue_rollout(queue, RUN, broken.name, 5)
    await queue.aclose()
    await admit(real_redis, 1)
    await drain(worker(redis_server.url, broken, FakeVLLM(), run=RUN))
    [dead] = await letters(real_redis, RUN)
    assert dead.is_job and dead.source == "job" and dead.letter.reason == "contract_error"
    assert dead.group_id == job_id(RUN, "gsm8k", 5)
    assert (await counters(real_redis))["drop:contract_error"] == 1
    assert await in_flight(real_redis) == 0

    # Three operators at once: one requeue, one job, which waits for the feeder.
    outcomes = await asyncio.gather(*(requeue(real_redis, RUN, [dead])
                                      for _ in range(3)))
    assert sorted(o.action for [o] in outcomes) == ["gone", "gone", "requeued"]
    assert await real_redis.zcard(queue_name(RUN)) == 0
    assert await real_redis.lrange(readmit_key(RUN, 0), 0, -1) == [dead.group_id.encode()]
    assert await in_flight(real_redis) == 1
    assert await readmit_once(redis_server.url, real_redis) == 1
    assert await real_redis.zcard(queue_name(RUN)) == 1
    assert await real_redis.llen(readmit_key(RUN, 0)) == 0

    fixed = FlakyEnv(lambda index, call: None)
    await drain(worker(redis_server.url, fixed, FakeVLLM(), run=RUN))
    [(_, entry)] = await real_redis.xrange(stream_key(RUN, 0, "traj"))
    assert decode_trajectory(entry).group_id == dead.group_id  # the same group id
    assert await letters(real_redis, RUN) == []
    state = await counters(real_redis)
    assert state["drop:contract_error"] == 0 and state["requeued"] == 1

    # Someone who listed the letter before it was requeued confirms only now: its job,
    # finished meanwhile, must not run again.
    [late] = await requeue(real_redis, RUN, [dead])
    assert late.action == "gone"
    assert await real_redis.zcard(queue_name(RUN)) == 0
    assert sum(fixed.calls.values()) == 1


async def test_requeue_twice_at_once_requeues_once(
        real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path) -> None:
    (tmp_path / "gold.yaml").write_text(NEEDS_GOLD)
    await Publisher(real_redis, RUN).publish(make_group(run=RUN, group_id="g", metadata={"q": 1}))
    await scorer_pass(redis_server.url, tmp_path / "gold.yaml")
    dead = await letters(real_redis, RUN)
    traj_before = await real_redis.xlen(stream_key(RUN, 0, "traj"))
    outcomes = await asyncio.gather(*(requeue(real_redis, RUN, dead)
                                      for _ in range(8)))
    assert sorted(o.action for [o] in outcomes) == ["gone"] * 7 + ["requeued"]
    assert await real_redis.xlen(stream_key(RUN, 0, "traj")) == traj_before + 1
    state = await counters(real_redis)
    assert state["requeued"] == 1 and state["drop:reward_missing_field"] == 0


async def test_a_requeued_copy_of_a_trained_group_is_not_trained_again(
        real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path) -> None:
    (tmp_path / "plain.yaml").write_text(NO_GOLD)
    group = make_group(run=RUN, group_id="once")
    await Publisher(real_redis, RUN).publish(group)
    await scorer_pass(redis_server.url, tmp_path / "plain.yaml")
    async with trainer_client(real_redis) as trainer:
        batch = await trainer.next_batch(groups=1, timeout_s=5)
        assert batch.group_ids == ["once"]
        await trainer.ack(batch)
    # A re-run of its job published a second copy, which the scorers dead-lettered.
    traj = stream_key(RUN, 0, "traj")
    copy_id = (await real_redis.xadd(traj, encode(group))).decode()  # type: ignore[arg-type]
    reader = StreamReader(real_redis, [traj], "scorers", "someone")
    await reader.read()
    await reader.dead_letter(Delivery(traj, copy_id, encode(group), 1), "unexpected_error", "x")
    [dead] = await letters(real_redis, RUN)
    [done] = await requeue(real_redis, RUN, [dead])
    assert done.action == "requeued"
    await scorer_pass(redis_server.url, tmp_path / "plain.yaml")
    assert (await counters(real_redis))["scored"] == 2  # the copy reached the scored stream
    async with trainer_client(real_redis) as trainer:
        again = await trainer.next_batch(groups=1, timeout_s=1)
    assert again.group_ids == []  # and the trainer dropped it as a duplicate
    state = await counters(real_redis)
    assert (state["drop:duplicate"], state["consumed"]) == (1, 1)


async def test_letters_that_must_not_be_requeued_are_skipped(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    await Publisher(real_redis, RUN).register()
    now_ms = int(time.time() * 1000)
    old = make_group(run=RUN, group_id="old")
    ids = [
        await put_letter(real_redis, at_ms=now_ms - 3, payload=encode(old),  # 7 h ago
                         source_id=f"{now_ms - 7 * 3_600_000}-0"),
        await put_letter(real_redis, at_ms=now_ms - 2, source="dead"),  # not traj/scored
    ]
    chosen = [item for entry_id in ids for item in await find(real_redis, RUN, entry_id)]
    outcomes = await requeue(real_redis, RUN, chosen)
    assert [o.action for o in outcomes] == ["skipped", "skipped"]
    assert "dedup window" in outcomes[0].detail
    assert "not this partition's traj or scored stream" in outcomes[1].detail
    assert len(await letters(real_redis, RUN)) == 2
    [forced, _] = await requeue(real_redis, RUN, chosen, dedup_window_s=None)
    assert forced.action == "requeued"


def test_a_letter_is_as_old_as_its_group_not_its_last_requeue() -> None:
    def letter(source_stream: str, source_id: str, payload: Fields | None = None) -> Letter:
        return Letter("rollq:{r:0}:dead", "1-0", DeadLetter(
            reason="unexpected_error", source_stream=source_stream, source_id=source_id,
            consumer_group="scorers", payload=payload or {}))

    now = 1_000_000.0
    recent = f"{int((now - 60) * 1000)}-0"
    fresh = letter("rollq:{r:0}:traj", f"{int((now - 3600) * 1000)}-0")
    old = letter("rollq:{r:0}:traj", f"{int((now - 6 * 3600) * 1000)}-0")
    job = letter("jobs:r", "r:gsm8k:3")
    assert not too_old(fresh, 6 * 3600, now)
    assert too_old(old, 6 * 3600, now)
    assert not too_old(job, 6 * 3600, now) and published_at(job) is None
    # requeued before, dead again: the entry is new, the group is not
    group = make_group(run="r").model_copy(update={"finished_at": now - 6 * 3600})
    requeued = letter("rollq:{r:0}:traj", recent, encode(group))
    assert published_at(requeued) == now - 6 * 3600 and too_old(requeued, 6 * 3600, now)
    ref = letter("rollq:{r:0}:scored", recent, encode(score(make_group(run="r")),
                                                         trajectory_id=old.letter.source_id))
    assert too_old(ref, 6 * 3600, now)  # the traj entry it names is old
    assert not too_old(letter("rollq:{r:0}:traj", recent, encode(make_group(run="r"))),
                       6 * 3600, now)  # finished_at 0: unknown, the id decides
