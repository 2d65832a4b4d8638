"""Every way a rollout job can fail ends in a retry or a counted dead letter (the rollout
rows of the failure taxonomy), and a run with flaky inference finishes its dataset."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from producers.admission import outstanding
from producers.envs.base import Env, Item, Rollout
from producers.envs.registry import make_env
from producers.feeder import Feeder, FeedPlan
from producers.inference import SamplingParams
from producers.publisher import Publisher
from producers.worker import build_worker, connect_queue, enqueue_rollout, job_id
from schemas import ContractError, InferenceUnavailable, decode_dead, decode_trajectory
from schemas.keys import ADMITTED_FIELD, counters_key, state_key, stream_key
from tests.producers.fake_vllm import FakeVLLM, fake_transport
from tests.redis_server import RedisServer

RUN = "jobs"
Behaviour = Callable[[int, int], Any]  # (item index, call number) -> None, or raise


class FlakyEnv:
    """The gsm8k env, with a behaviour run before each rollout (it may raise or sleep)."""

    def __init__(self, behave: Behaviour) -> None:
        self.inner: Env = make_env("gsm8k")
        self.name = self.inner.name
        self.behave = behave
        self.calls: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self.inner)

    def item(self, index: int) -> Item:
        return self.inner.item(index)

    async def rollout(self, item: Item, pool: Any, **kwargs: Any) -> Rollout:
        self.calls[item.index] += 1
        result = self.behave(item.index, self.calls[item.index])
        if asyncio.iscoroutine(result):
            await result
        return await self.inner.rollout(item, pool, **kwargs)


def worker(url: str, env: FlakyEnv, fake: FakeVLLM, *, max_tries: int = 3,
           job_timeout_s: float = 5.0, concurrency: int = 4, run: str = RUN) -> Any:
    return build_worker(
        redis_url=url, run=run, env_factory=lambda: env, inference_urls=[fake.base_url],
        model=None, sampling=SamplingParams(max_tokens=8), group_size=2,
        concurrency=concurrency, job_timeout_s=job_timeout_s, max_tries=max_tries,
        request_timeout_s=5, burst=True, retry_base_s=0.01, transport=fake_transport(fake))


async def run_positions(url: str, redis: aioredis.Redis, env: FlakyEnv, positions: list[int],
                        **options: Any) -> None:
    await Publisher(redis, RUN).register()
    queue = await connect_queue(url)
    try:
        for position in positions:
            assert await enqueue_rollout(queue, RUN, env.name, position)
    finally:
        await queue.aclose()
    await redis.hincrby(state_key(RUN), ADMITTED_FIELD, len(positions))
    arq_worker = worker(url, env, FakeVLLM(), **options)
    try:
        await asyncio.wait_for(arq_worker.main(), 60)
    finally:
        await arq_worker.close()


async def dead_letters(redis: aioredis.Redis) -> dict[str, tuple[str, str]]:
    letters = [decode_dead(f) for _, f in await redis.xrange(stream_key(RUN, 0, "dead"))]
    return {letter.source_id: (letter.reason, letter.detail) for letter in letters}


async def slot_freed(redis: aioredis.Redis) -> bool:
    admitted = int(await redis.hget(state_key(RUN), ADMITTED_FIELD) or 0)
    counters = {k.decode(): int(v) for k, v in
                (await redis.hgetall(counters_key(RUN, 0))).items()}
    published = int(await redis.xlen(stream_key(RUN, 0, "traj")))
    return outstanding(admitted, counters)[1] == published  # only published groups in flight


def _raise(exc: BaseException) -> Behaviour:
    def behave(index: int, call: int) -> None:
        raise exc

    return behave


ROWS: dict[str, tuple[Behaviour, str, int]] = {
    # name: (behaviour, expected reason, expected calls before the dead letter)
    "contract error: at once": (_raise(ContractError("prompt too long")), "contract_error", 1),
    "inference unavailable: retried": (_raise(InferenceUnavailable("refused")),
                                       "inference_unavailable", 3),
    "unexpected exception: retried": (_raise(KeyError("bug")), "unexpected_error", 3),
    "exception group of a multi-turn env": (
        _raise(ExceptionGroup("episodes", [InferenceUnavailable("refused")])),
        "inference_unavailable", 3),
    "job timeout: retried": (lambda index, call: asyncio.sleep(30), "job_timeout", 3),
}


@pytest.mark.parametrize("row", sorted(ROWS))
async def test_each_failure_ends_in_a_counted_dead_letter(
        row: str, real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    behave, reason, calls = ROWS[row]
    env = FlakyEnv(behave)
    await run_positions(redis_server.url, real_redis, env, [0, 1], job_timeout_s=0.3)
    letters = await dead_letters(real_redis)
    assert set(letters) == {job_id(RUN, "gsm8k", 0), job_id(RUN, "gsm8k", 1)}
    assert {r for r, _ in letters.values()} == {reason}
    assert env.calls == Counter({0: calls, 1: calls})
    if calls > 1:
        assert all(d.startswith(f"after {calls} tries") for _, d in letters.values())
    assert int(await real_redis.hget(counters_key(RUN, 0), f"drop:{reason}")) == 2
    assert await slot_freed(real_redis)


async def test_a_transient_failure_then_success_publishes_once(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    def behave(index: int, call: int) -> None:
        if call < 3:
            raise InferenceUnavailable("refused")

    env = FlakyEnv(behave)
    await run_positions(redis_server.url, real_redis, env, [0, 1, 2])
    assert await dead_letters(real_redis) == {}
    groups = [decode_trajectory(f) for _, f in
              await real_redis.xrange(stream_key(RUN, 0, "traj"))]
    assert sorted(g.group_id for g in groups) == [job_id(RUN, "gsm8k", p) for p in range(3)]


async def test_a_try_after_a_killed_last_try_is_dead_lettered(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    """arq starts try max_tries + 1 only when the last try's worker died: the body
    dead-letters the job instead of letting arq fail it silently."""
    env = FlakyEnv(lambda index, call: None)
    await real_redis.set(f"arq:retry:{job_id(RUN, 'gsm8k', 0)}", 3)  # 3 tries started
    await run_positions(redis_server.url, real_redis, env, [0], max_tries=3)
    assert env.calls == Counter()  # not run again
    ((reason, detail),) = (await dead_letters(real_redis)).values()
    assert reason == "job_timeout" and "worker died" in detail
    assert await slot_freed(real_redis)


@pytest.mark.slow
async def test_flaky_inference_and_timeouts_never_stall_the_dataset(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    """30% of inference calls fail and 5% of tries run past the job timeout: every item
    ends published or dead-lettered with a reason, and the feeder never stalls."""
    rng = random.Random(7)

    def behave(index: int, call: int) -> Any:
        roll = rng.random()
        if roll < 0.30:
            raise InferenceUnavailable("injected: connection refused")
        if roll < 0.35:
            return asyncio.sleep(30)  # past the job timeout
        return None

    env = FlakyEnv(behave)
    await Publisher(real_redis, RUN).register()
    queue = await connect_queue(redis_server.url)
    items = 40

    async def enqueue(position: int) -> bool:
        return await enqueue_rollout(queue, RUN, env.name, position)

    feeder = Feeder(real_redis, RUN, FeedPlan(dataset_size=items, epochs=1, max_staleness=0,
                                              batch_groups=items), enqueue)
    arq_worker = worker(redis_server.url, env, FakeVLLM(), max_tries=3, job_timeout_s=0.3,
                        concurrency=8)
    try:
        assert await feeder.feed_once() == items
        await asyncio.wait_for(arq_worker.main(), 120)
    finally:
        await arq_worker.close()
        await queue.aclose()
    published = {decode_trajectory(f).group_id for _, f in
                 await real_redis.xrange(stream_key(RUN, 0, "traj"))}
    letters = await dead_letters(real_redis)
    assert published | set(letters) == {job_id(RUN, env.name, p) for p in range(items)}
    assert not published & set(letters)
    assert {reason for reason, _ in letters.values()} <= {"inference_unavailable",
                                                          "job_timeout"}
    assert len(published) > items // 2
    assert await slot_freed(real_redis)  # nothing holds a slot it will never give back
