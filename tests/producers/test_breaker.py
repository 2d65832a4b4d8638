"""A misconfigured run does not burn its dataset: the circuit breaker stops admission after a
streak of same-reason job failures, and requeued jobs go through admission like new ones
(issue 32, items 1-2). Real redis-server, real feeder, real arq worker pool."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from structlog.testing import capture_logs

from rollq.ops.cli import build_parser
from rollq.ops.cli.common import Exit
from rollq.ops.cli.runs import runs as runs_command
from rollq.ops.dead import letters, requeue
from rollq.ops.local.stack import free_port
from rollq.ops.status import collect_status, render_status
from rollq.producers.envs.registry import make_env
from rollq.producers.feeder import Feeder, FeedPlan
from rollq.producers.inference import SamplingParams
from rollq.producers.publisher import Publisher
from rollq.producers.worker import (
    build_worker,
    close_worker,
    connect_queue,
    enqueue_rollout,
    job_id,
    queue_name,
    requeue_rollout,
)
from rollq.schemas import breaker
from rollq.schemas.keys import (
    ADMITTED_FIELD,
    CONSUMED_COUNTER,
    counters_key,
    readmit_key,
    state_key,
)
from tests.redis_server import RedisServer
from tests.waiting import until

RUN = "breaker"
BATCH, STALENESS = 4, 1
BUDGET = (STALENESS + 1) * BATCH



async def dead_count(redis: aioredis.Redis) -> int:
    return len(await letters(redis, RUN))


async def test_a_broken_inference_url_stops_admission_within_twice_the_budget(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    env = make_env("gsm8k")
    await Publisher(real_redis, RUN).register()
    queue = await connect_queue(redis_server.url)

    async def enqueue(position: int) -> bool:
        return await enqueue_rollout(queue, RUN, env.name, position)

    plan = FeedPlan(dataset_size=len(env), epochs=1, max_staleness=STALENESS,
                    batch_groups=BATCH)
    feeder = Feeder(real_redis, RUN, plan, enqueue, trip_after=10)
    assert feeder.trip_after == BUDGET  # capped at the first budget
    pool = build_worker(
        redis_url=redis_server.url, run=RUN, env_factory=lambda: env,
        inference_urls=[f"http://127.0.0.1:{free_port()}"], model="m",
        sampling=SamplingParams(max_tokens=8), group_size=2, concurrency=BUDGET,
        job_timeout_s=30, max_tries=1, request_timeout_s=5, retry_base_s=0.01)
    stop = asyncio.Event()
    with capture_logs() as logs:
        feeding = asyncio.create_task(feeder.run_until(stop, 0.05))
        working = asyncio.create_task(pool.main())
        try:
            tripped = await until(lambda: breaker.read(real_redis, RUN), "the breaker to trip")

            async def settled() -> bool:  # every admitted job has ended
                admitted = int(await real_redis.hget(state_key(RUN), ADMITTED_FIELD) or 0)
                return (await real_redis.zcard(queue_name(RUN)) == 0
                        and await dead_count(real_redis) == admitted)

            await until(settled, "the jobs in flight at the trip to end")
            admitted = int(await real_redis.hget(state_key(RUN), ADMITTED_FIELD))
            await asyncio.sleep(0.5)  # ten feeder polls: nothing more is admitted
            assert int(await real_redis.hget(state_key(RUN), ADMITTED_FIELD)) == admitted
        finally:
            stop.set()
            working.cancel()
            await asyncio.gather(feeding, working, return_exceptions=True)
            await close_worker(pool)
            await queue.aclose()
    dead = await dead_count(real_redis)
    assert BUDGET <= dead <= 2 * BUDGET
    assert tripped.reason == "inference_unavailable" and tripped.streak >= BUDGET
    stopped = [e for e in logs if e["event"] == "admission_stopped"]
    assert len(stopped) == 1 and stopped[0]["log_level"] == "error"
    assert f"rollq runs resume {RUN}" in stopped[0]["message"]

    status = await collect_status(real_redis, RUN)
    assert status.breaker == tripped
    assert render_status(status).startswith(f"STOPPED: admission stopped: the last "
                                            f"{tripped.streak} rollout jobs of run '{RUN}'")

    # `rollq runs resume RUN` closes it: the feeder admits again.
    args = build_parser().parse_args(["runs", "resume", RUN, "--redis-url", redis_server.url])
    assert await runs_command(args, {}) == Exit.OK
    assert await breaker.read(real_redis, RUN) is None
    queue = await connect_queue(redis_server.url)
    try:
        with capture_logs() as logs:
            assert await Feeder(real_redis, RUN, plan, enqueue, trip_after=10).feed_once() > 0
    finally:
        await queue.aclose()


async def test_a_published_group_or_another_reason_ends_the_streak(
        real_redis: aioredis.Redis) -> None:
    assert await breaker.record_failure(real_redis, RUN, "contract_error", "404") == 1
    assert await breaker.record_failure(real_redis, RUN, "contract_error", "404") == 2
    assert await breaker.record_failure(real_redis, RUN, "inference_unavailable", "x") == 1
    await breaker.record_success(real_redis, RUN)
    assert await breaker.trip(real_redis, RUN, 1) is None
    assert await breaker.record_failure(real_redis, RUN, "contract_error", "404") == 1
    assert await breaker.record_failure(real_redis, RUN, "reward_error", "not ours") == 0
    assert await breaker.trip(real_redis, RUN, 1) is None
    for _ in range(3):
        await breaker.record_failure(real_redis, RUN, "job_timeout", "slow")
    assert await breaker.trip(real_redis, RUN, 4) is None
    opened = await breaker.trip(real_redis, RUN, 3)
    assert opened is not None and (opened.reason, opened.streak) == ("job_timeout", 3)
    assert await breaker.resume(real_redis, RUN) == opened
    assert await breaker.read(real_redis, RUN) is None
    assert await breaker.trip(real_redis, RUN, 3) is None  # the streak was forgotten too


async def test_a_requeue_of_200_letters_never_queues_more_than_the_budget(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    items, failed = 400, 200
    publisher = Publisher(real_redis, RUN)
    await publisher.register()
    for position in range(failed):
        await publisher.publish_failure(job_id(RUN, "gsm8k", position), "contract_error",
                                        "404 model not found")
    await real_redis.hset(state_key(RUN), mapping={ADMITTED_FIELD: failed, "cursor": failed})
    outcomes = await requeue(real_redis, RUN, await letters(real_redis, RUN))
    assert [o.action for o in outcomes] == ["requeued"] * failed
    assert await real_redis.zcard(queue_name(RUN)) == 0
    assert await real_redis.llen(readmit_key(RUN, 0)) == failed
    status = await collect_status(real_redis, RUN)
    assert status.accounting is not None and status.accounting.waiting == failed
    assert status.accounting.unaccounted == 0

    queue = await connect_queue(redis_server.url)

    async def enqueue(position: int) -> bool:
        return await enqueue_rollout(queue, RUN, "gsm8k", position)

    async def requeue_job(env: str, position: int) -> bool:
        return await requeue_rollout(queue, RUN, env, position)

    feeder = Feeder(real_redis, RUN, FeedPlan(dataset_size=items, epochs=1,
                                              max_staleness=STALENESS, batch_groups=BATCH),
                    enqueue, requeue=requeue_job)
    most_queued = 0
    try:
        for step in range(failed // BATCH):
            await feeder.feed_once()
            await feeder.feed_once()  # a second pass admits nothing more
            queued = int(await real_redis.zcard(queue_name(RUN)))
            most_queued = max(most_queued, queued)
            assert queued <= BUDGET
            # The trainer trains one batch of what the jobs made: BATCH jobs leave the
            # queue and their groups are consumed; it publishes the next policy version.
            taken = await real_redis.zrange(queue_name(RUN), 0, BATCH - 1)
            await real_redis.zrem(queue_name(RUN), *taken)
            await real_redis.hincrby(counters_key(RUN, 0), CONSUMED_COUNTER, len(taken))
            await real_redis.hset(state_key(RUN), "policy_version", step + 1)
    finally:
        await queue.aclose()
    assert most_queued == BUDGET
    assert feeder.readmitted == failed  # every requeued job came back, oldest first
    assert int(await real_redis.hget(state_key(RUN), "cursor")) > failed  # then new items
