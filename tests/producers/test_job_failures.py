"""Every way a rollout job can fail ends in a retry or a counted dead letter (the rollout
rows of the failure taxonomy), a worker killed mid-job loses nothing, and a run with flaky
inference finishes its dataset."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from structlog.testing import capture_logs

from rollq.producers.admission import outstanding
from rollq.producers.envs.base import Env, Item, Rollout
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
from rollq.schemas import (
    BrokerUnavailable,
    ContractError,
    InferenceUnavailable,
    decode_dead,
    decode_trajectory,
)
from rollq.schemas.keys import (
    ADMITTED_FIELD,
    CONSUMED_COUNTER,
    POLICY_VERSION_FIELD,
    counters_key,
    state_key,
    stream_key,
)
from tests.producers.fake_vllm import FakeVLLM, fake_transport
from tests.producers.jobs import enqueue_positions
from tests.redis_server import RedisServer
from tests.waiting import until

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


def worker(url: str, env: Env, fake: FakeVLLM, *, max_tries: int = 3,
           job_timeout_s: float = 5.0, concurrency: int = 4, run: str = RUN,
           **options: Any) -> Any:
    options.setdefault("burst", True)
    options.setdefault("retry_base_s", 0.01)
    return build_worker(
        redis_url=url, run=run, env_factory=lambda: env, inference_urls=[fake.base_url],
        model=None, sampling=SamplingParams(max_tokens=8), group_size=2,
        concurrency=concurrency, job_timeout_s=job_timeout_s, max_tries=max_tries,
        request_timeout_s=5, transport=fake_transport(fake), **options)


async def run_positions(url: str, redis: aioredis.Redis, env: Env, positions: list[int],
                        *, fake: FakeVLLM | None = None, **options: Any) -> None:
    await Publisher(redis, RUN).register()
    await enqueue_positions(url, RUN, env.name, positions)
    await redis.hincrby(state_key(RUN), ADMITTED_FIELD, len(positions))
    await drain(url, env, fake or FakeVLLM(), **options)


async def drain(url: str, env: Env, fake: FakeVLLM, **options: Any) -> None:
    """Run a burst worker until the queue is empty."""
    arq_worker = worker(url, env, fake, **options)
    try:
        await asyncio.wait_for(arq_worker.main(), 60)
    finally:
        await close_worker(arq_worker)


async def published(redis: aioredis.Redis) -> list[str]:
    return [decode_trajectory(f).group_id for _, f in
            await redis.xrange(stream_key(RUN, 0, "traj"))]


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
    # Only the timeout row needs a short timeout; the others fail at once, and 0.3 s is too
    # short a deadline for them on a loaded machine (load 15-20: a try timed out before its
    # env raised, and the row read job_timeout)
    timeout_s = 0.3 if reason == "job_timeout" else 10.0
    await run_positions(redis_server.url, real_redis, env, [0, 1], job_timeout_s=timeout_s)
    letters = await dead_letters(real_redis)
    assert set(letters) == {job_id(RUN, "gsm8k", 0), job_id(RUN, "gsm8k", 1)}
    assert {r for r, _ in letters.values()} == {reason}
    assert env.calls == Counter({0: calls, 1: calls})
    if calls > 1:
        assert all(d.startswith(f"after {calls} tries") for _, d in letters.values())
    if reason == "job_timeout":
        assert all("ran past the 0.3 s job timeout" in d for _, d in letters.values())
    assert int(await real_redis.hget(counters_key(RUN, 0), f"drop:{reason}")) == 2
    assert await slot_freed(real_redis)


@pytest.mark.parametrize(("env", "items", "detail"), [
    ("math", None, "the job is for env 'math', this worker runs 'gsm8k'"),
    ("gsm8k", 5000, "the feeder's env 'gsm8k' has 5000 items, this worker's has 200"),
], ids=["another-env", "another-dataset"])
async def test_a_job_for_another_env_is_dead_lettered_not_rolled_out(
        env: str, items: int | None, detail: str, real_redis: aioredis.Redis,
        redis_server: RedisServer) -> None:
    """Jobs address items by position: a worker started with another ``--env`` or another
    dataset (``--env-option``) than the feeder's would roll out other items under the
    jobs' ids. It dead-letters them instead (``contract_error``, counted, requeueable
    once the workers are started right); a job that names no size is not checked."""
    gsm8k = FlakyEnv(lambda index, call: None)
    await Publisher(real_redis, RUN).register()
    queue = await connect_queue(redis_server.url)
    try:
        await enqueue_rollout(queue, RUN, env, 0, items=items)
        await enqueue_rollout(queue, RUN, "gsm8k", 1)  # by hand: nothing to check against
    finally:
        await queue.aclose()
    await real_redis.hincrby(state_key(RUN), ADMITTED_FIELD, 2)
    await drain(redis_server.url, gsm8k, FakeVLLM())
    letters = await dead_letters(real_redis)
    assert list(letters) == [job_id(RUN, env, 0)]
    reason, text = letters[job_id(RUN, env, 0)]
    assert reason == "contract_error" and detail in text
    assert gsm8k.calls == Counter({1: 1})  # the mismatched job never rolled out
    assert await published(real_redis) == [job_id(RUN, "gsm8k", 1)]
    assert await slot_freed(real_redis)


@pytest.mark.slow
async def test_a_multi_turn_env_that_loses_inference_is_retried_then_dead_lettered(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    """A group's episodes run in a TaskGroup, which wraps their ``InferenceUnavailable`` in
    an ``ExceptionGroup``: still a transient failure, retried, then dead-lettered as
    ``inference_unavailable`` with the cause."""
    fake = FakeVLLM()
    fake.inject_faults(failure_rate=1.0, kinds=("503",), paths=("/v1/completions",))
    env = make_env("guess")
    await run_positions(redis_server.url, real_redis, env, [0], fake=fake, max_tries=2)
    ((reason, detail),) = (await dead_letters(real_redis)).values()
    assert reason == "inference_unavailable"
    assert detail.startswith("after 2 tries") and "answered 503" in detail
    # each try: one episode's 4 pool attempts, then the TaskGroup cancels its sibling
    assert fake.counts["/v1/completions"] >= 2 * 4
    assert await slot_freed(real_redis)


async def test_a_transient_failure_then_success_publishes_once(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    def behave(index: int, call: int) -> None:
        if call < 3:
            raise InferenceUnavailable("refused")

    env = FlakyEnv(behave)
    await run_positions(redis_server.url, real_redis, env, [0, 1, 2])
    assert await dead_letters(real_redis) == {}
    assert sorted(await published(real_redis)) == [job_id(RUN, "gsm8k", p) for p in range(3)]


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


@pytest.mark.parametrize("refusal", [
    BrokerUnavailable("redis unavailable while recording a failure"),
    redis_errors.ResponseError("WAIT cannot be used with replica instances"),
], ids=["unavailable", "refused"])
async def test_a_dead_letter_that_cannot_be_written_is_retried_not_lost(
        real_redis: aioredis.Redis, redis_server: RedisServer,
        monkeypatch: pytest.MonkeyPatch, refusal: Exception) -> None:
    """Redis away or refusing the dead letter must not let arq record the job as failed
    (which would keep its slot forever): the job is retried, and the next try writes it."""
    write = Publisher.publish_failure
    refusals = [refusal]

    async def flaky_write(self: Publisher, *args: Any, **kwargs: Any) -> str:
        if refusals:
            raise refusals.pop()
        return await write(self, *args, **kwargs)

    monkeypatch.setattr(Publisher, "publish_failure", flaky_write)
    env = FlakyEnv(_raise(ContractError("bad item")))
    await run_positions(redis_server.url, real_redis, env, [0])
    assert not refusals and env.calls == Counter({0: 2})
    assert {r for r, _ in (await dead_letters(real_redis)).values()} == {"contract_error"}
    assert int(await real_redis.hget(counters_key(RUN, 0), "drop:contract_error")) == 1
    assert await slot_freed(real_redis)


async def test_a_dead_lettered_job_is_requeued_under_the_same_group_id(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    broken = {4}

    def behave(index: int, call: int) -> None:
        if index in broken:
            raise ContractError("bad item")

    env = FlakyEnv(behave)
    await run_positions(redis_server.url, real_redis, env, [4])
    ident = job_id(RUN, env.name, 4)
    assert set(await dead_letters(real_redis)) == {ident}
    queue = await connect_queue(redis_server.url)
    try:
        assert not await enqueue_rollout(queue, RUN, env.name, 4)  # arq still knows the id
        broken.clear()
        assert await requeue_rollout(queue, RUN, env.name, 4)
        assert not await requeue_rollout(queue, RUN, env.name, 4)  # queued: nothing to do
    finally:
        await queue.aclose()
    await drain(redis_server.url, env, FakeVLLM(), max_tries=1)  # starts again at try 1
    assert await published(real_redis) == [ident]
    assert env.calls == Counter({4: 2})


async def test_closing_a_worker_whose_job_is_cancelled_before_its_handler_still_closes_it(
        redis_server: RedisServer) -> None:
    """A job task cancelled by the shutdown before arq's handler catches it (while arq reads
    the job from Redis) ends cancelled: arq's own ``close`` then raises ``CancelledError``
    and leaves its connections open (a CI run under load failed on those). ``close_worker``
    closes it all the same."""
    for close, raises in ((lambda w: w.close(), True), (close_worker, False)):
        arq_worker = worker(redis_server.url, FlakyEnv(lambda index, call: None), FakeVLLM())
        await arq_worker.main()  # a burst on an empty queue: connects, then returns
        arq_worker.tasks["picked"] = asyncio.create_task(asyncio.sleep(60))  # a job in hand
        try:
            if raises:
                with pytest.raises(asyncio.CancelledError):
                    await close(arq_worker)
                assert arq_worker._pool is not None  # never closed
            else:
                await close(arq_worker)
                assert arq_worker._pool is None and not arq_worker.tasks
        finally:
            if arq_worker._pool is not None:
                await close_worker(arq_worker)  # what was left open, on_shutdown's too


async def test_a_try_cut_short_by_a_graceful_stop_goes_back_to_the_queue_uncounted(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    started = asyncio.Event()

    async def hang() -> None:
        started.set()
        await asyncio.sleep(60)

    env = FlakyEnv(lambda index, call: hang() if call == 1 else None)
    await Publisher(real_redis, RUN).register()
    queue = await connect_queue(redis_server.url)
    try:
        assert await enqueue_rollout(queue, RUN, env.name, 2)
    finally:
        await queue.aclose()
    stopping = worker(redis_server.url, env, FakeVLLM(), max_tries=1, burst=False, grace_s=0)
    running = asyncio.create_task(stopping.async_run())
    try:
        await asyncio.wait_for(started.wait(), 20)
        stopping.handle_sig_wait_for_completion(signal.SIGTERM)  # what `rollq workers` does
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(running, 20)
    finally:
        await close_worker(stopping)
    ident = job_id(RUN, env.name, 2)
    assert await real_redis.zscore(queue_name(RUN), ident) is not None  # back in the queue
    assert await published(real_redis) == [] and await dead_letters(real_redis) == {}
    await drain(redis_server.url, env, FakeVLLM(), max_tries=1)  # try 1 again, not try 2
    assert await published(real_redis) == [ident]
    assert await dead_letters(real_redis) == {}


@pytest.mark.slow
async def test_jobs_retry_concurrently_and_name_the_server_and_the_cause(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    """With the inference server refusing connections, 4 jobs at concurrency 4 fail
    together (not one retry cycle after another), and the log lines and dead letters name
    the server's URL and the cause."""
    fake = FakeVLLM()
    fake.down = True
    env = FlakyEnv(lambda index, call: None)
    with capture_logs() as logs:
        await run_positions(redis_server.url, real_redis, env, [0, 1, 2, 3], fake=fake,
                            max_tries=1, concurrency=4, job_timeout_s=30)
    letters = [decode_dead(f) for _, f in await real_redis.xrange(stream_key(RUN, 0, "dead"))]
    assert len(letters) == 4 and {letter.reason for letter in letters} == {
        "inference_unavailable"}
    for letter in letters:
        assert fake.base_url in letter.detail and "ConnectError" in letter.detail
    # one shared retry cycle (~3.5 s of pool back-off), not four in a row (>= 10 s apart);
    # quietly they die within ~0.1 s of each other
    spread = max(x.dead_at for x in letters) - min(x.dead_at for x in letters)
    assert spread < 3.0
    lines = [line for line in logs if line["event"] == "rollout_dead_lettered"]
    assert len(lines) == 4
    for line in lines:
        assert line["servers"] == [fake.base_url]
        assert fake.base_url in line["detail"] and "connection refused" in line["detail"]
    assert await slot_freed(real_redis)


CHILD_WORKER = """
import asyncio, sys
from rollq.producers.inference import SamplingParams
from rollq.producers.worker import build_worker
from tests.producers.fake_vllm import FakeVLLM, fake_transport
from tests.producers.slow_env import SlowEnv

async def main() -> None:
    fake = FakeVLLM()
    worker = build_worker(
        redis_url=sys.argv[1], run=sys.argv[2], env_factory=lambda: SlowEnv(60.0),
        inference_urls=[fake.base_url], model=None, sampling=SamplingParams(max_tokens=8),
        group_size=2, concurrency=1, job_timeout_s=2.0, max_tries=3, request_timeout_s=5,
        timeout_margin_s=1.0, transport=fake_transport(fake))
    await worker.main()

asyncio.run(main())
"""
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
async def test_a_job_whose_worker_was_killed_is_run_again_after_the_job_timeout(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    """SIGKILL mid-job: arq holds the job for the job timeout (+ margins), then a second
    worker runs it; the group is published under its group id, nothing is dead-lettered."""
    await Publisher(real_redis, RUN).register()
    queue = await connect_queue(redis_server.url)
    try:
        assert await enqueue_rollout(queue, RUN, "gsm8k", 7)
    finally:
        await queue.aclose()
    await real_redis.hincrby(state_key(RUN), ADMITTED_FIELD, 1)
    ident = job_id(RUN, "gsm8k", 7)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD_WORKER, redis_server.url, RUN, cwd=REPO,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        await until(lambda: real_redis.exists(f"arq:in-progress:{ident}"),
                    "the first worker to start the job")
    finally:
        child.kill()
        await child.wait()
    killed_at = time.monotonic()
    held_s = await real_redis.pttl(f"arq:in-progress:{ident}") / 1000
    assert held_s > 5  # job timeout 2 s + margin 1 s + arq's 10 s, from the try's start
    env = FlakyEnv(lambda index, call: None)
    await drain(redis_server.url, env, FakeVLLM(), job_timeout_s=2.0, timeout_margin_s=1.0)
    assert time.monotonic() - killed_at >= held_s - 0.5  # not before arq released it
    groups = await published(real_redis)
    assert set(groups) == {ident} and len(groups) <= 2  # a duplicate is dropped downstream
    assert env.calls == Counter({7: 1})
    assert await dead_letters(real_redis) == {}
    assert await slot_freed(real_redis)


async def consume_until_accounted(redis: aioredis.Redis, total: int, batch: int) -> None:
    """A stand-in trainer: consumes what is published and steps a version per batch, until
    every position is published or dead-lettered."""
    while True:
        groups = set(await published(redis))
        await redis.hset(counters_key(RUN, 0), CONSUMED_COUNTER, len(groups))
        await redis.hset(state_key(RUN), POLICY_VERSION_FIELD, len(groups) // batch)
        if len(groups | set(await dead_letters(redis))) >= total:
            return
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_a_run_with_failing_inference_and_timeouts_finishes_its_dataset(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    """The acceptance scenario: the inference server fails 30% of calls (refused
    connections and 503s) and answers 5% only after the job timeout. The real feeder, with
    a budget of one batch ahead of the trainer, admits the whole dataset: every item ends
    published or dead-lettered with a reason, and no slot leaks (a leak would stall it)."""
    items, batch = 40, 6
    fake = FakeVLLM()
    fake.inject_faults(failure_rate=0.30, slow_rate=0.05, slow_s=60, seed=11)
    env = FlakyEnv(lambda index, call: None)
    await Publisher(real_redis, RUN).register()
    queue = await connect_queue(redis_server.url)

    async def enqueue(position: int) -> bool:
        return await enqueue_rollout(queue, RUN, env.name, position)

    feeder = Feeder(real_redis, RUN, FeedPlan(dataset_size=items, epochs=1, max_staleness=0,
                                              batch_groups=batch), enqueue)
    pool = worker(redis_server.url, env, fake, max_tries=4, job_timeout_s=1.5, concurrency=8,
                  burst=False, retry_base_s=0.05, timeout_margin_s=1.0)
    stop = asyncio.Event()
    feeding = asyncio.create_task(feeder.run_until(stop, 0.05))
    working = asyncio.create_task(pool.main())
    try:
        await asyncio.wait_for(consume_until_accounted(real_redis, items, batch), 110)
        await asyncio.wait_for(feeding, 5)  # it saw the whole dataset admitted
    finally:
        stop.set()
        working.cancel()
        await asyncio.gather(feeding, working, return_exceptions=True)
        await close_worker(pool)
        await queue.aclose()
    groups = set(await published(real_redis))
    letters = await dead_letters(real_redis)
    assert groups | set(letters) == {job_id(RUN, env.name, p) for p in range(items)}
    assert not groups & set(letters)
    assert all(reason in {"inference_unavailable", "job_timeout"} for reason, _ in
               letters.values())
    assert all("job timeout" in detail for reason, detail in letters.values()
               if reason == "job_timeout")
    assert fake.injected["connect"] and fake.injected["503"] and fake.injected["slow"]
    assert int(await real_redis.hget(state_key(RUN), ADMITTED_FIELD)) == items
    counters = {k.decode(): int(v) for k, v in
                (await real_redis.hgetall(counters_key(RUN, 0))).items()}
    assert outstanding(items, counters)[1] == 0  # the trainer consumed every published group


