"""The entry-size cap: a group whose encoded entry is above ``max_entry_bytes`` is never
XADDed; its rollout job is dead-lettered at once as ``entry_too_large``, counted, and its
admission slot freed."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from rollq.ops.roles import run_workers
from rollq.ops.settings import WorkerSettings
from rollq.producers.admission import outstanding
from rollq.producers.publisher import EntryTooLarge, Publisher
from rollq.producers.worker import connect_queue, enqueue_rollout, job_id
from rollq.schemas import decode_dead, encode
from rollq.schemas.failures import ENTRY_TOO_LARGE, Kind, classify
from rollq.schemas.keys import ADMITTED_FIELD, counters_key, state_key, stream_key
from tests.factories import make_group
from tests.producers.fake_vllm import FakeVLLM, fake_transport
from tests.redis_server import RedisServer

RUN = "entrycap"


async def test_the_cap_is_inclusive_and_nothing_above_it_is_written(
        real_redis: aioredis.Redis) -> None:
    group = make_group(run=RUN, group_id="big")
    size = sum(len(k) + len(v) for k, v in encode(group).items())
    with pytest.raises(EntryTooLarge, match=f"above max_entry_bytes {size - 1:,}") as caught:
        await Publisher(real_redis, RUN, max_entry_bytes=size - 1).publish(group)
    assert await real_redis.xlen(stream_key(RUN, 0, "traj")) == 0
    failure = classify(caught.value)
    assert (failure.kind, failure.reason) == (Kind.CONTRACT, ENTRY_TOO_LARGE)
    await Publisher(real_redis, RUN, max_entry_bytes=size).publish(group)
    assert await real_redis.xlen(stream_key(RUN, 0, "traj")) == 1


def test_the_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_entry_bytes"):
        Publisher(aioredis.Redis(), RUN, max_entry_bytes=0)
    assert WorkerSettings().max_entry_bytes == 64 * 2**20


async def test_a_worker_dead_letters_a_group_above_the_cap_without_retrying(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    fake = FakeVLLM()
    fake.responder = lambda prompt, index: "x" * 400  # 400 tokens per completion
    await Publisher(real_redis, RUN).register()
    queue = await connect_queue(redis_server.url)
    for position in (0, 1):
        assert await enqueue_rollout(queue, RUN, "gsm8k", position)
    await queue.aclose()
    await real_redis.hincrby(state_key(RUN), ADMITTED_FIELD, 2)
    settings = WorkerSettings(redis_url=redis_server.url, run=RUN, inference=[fake.base_url],
                              group_size=2, max_tokens=512, max_entry_bytes=4096)
    await run_workers(settings, burst=True, transport=fake_transport(fake))

    assert await real_redis.xlen(stream_key(RUN, 0, "traj")) == 0
    letters = [decode_dead(f) for _, f in await real_redis.xrange(stream_key(RUN, 0, "dead"))]
    assert sorted(letter.source_id for letter in letters) == [
        job_id(RUN, "gsm8k", 0), job_id(RUN, "gsm8k", 1)]
    for letter in letters:
        assert letter.reason == ENTRY_TOO_LARGE
        assert "above max_entry_bytes 4,096" in letter.detail
        assert not letter.detail.startswith("after")  # a contract failure: never retried
        assert letter.payload == {}  # the oversized group is not copied into the letter
    assert sum(fake.counts[p] for p in ("/v1/completions", "/v1/chat/completions")) == 2
    counters = {k.decode(): int(v) for k, v in
                (await real_redis.hgetall(counters_key(RUN, 0))).items()}
    assert counters[f"drop:{ENTRY_TOO_LARGE}"] == 2
    assert outstanding(2, counters) == (0, 0)  # both admission slots freed
