"""The sync facade drives the same client from a plain (non-async) training loop."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import fakeredis
import pytest
import redis as sync_redis
import redis.asyncio as aioredis

from rollq.consumers.trainer import SyncTrainerClient, TrainerClientSettings
from rollq.schemas import encode
from rollq.schemas.keys import counters_key, state_key, stream_key
from tests.factories import make_group, score
from tests.redis_server import RedisServer
from tests.trainer.helpers import FakeVllm

RUN = "sync"
Source = Callable[[], aioredis.Redis | str]


@pytest.fixture(params=["fake", "real"])
def clients(request: pytest.FixtureRequest) -> Iterator[tuple[Source, sync_redis.Redis]]:
    """A maker of what a SyncTrainerClient is given (an async client, fresh per facade since
    each facade runs its own loop, or a URL), and a plain client to publish with."""
    if request.param == "fake":
        server = fakeredis.FakeServer()
        yield (lambda: fakeredis.aioredis.FakeRedis(server=server)), fakeredis.FakeRedis(
            server=server)
    else:
        redis_server: RedisServer = request.getfixturevalue("redis_server")
        plain = sync_redis.Redis.from_url(redis_server.url)
        plain.flushall()
        yield (lambda: redis_server.url), plain
        plain.close()


def publish(plain: sync_redis.Redis, *group_ids: str) -> None:
    plain.hsetnx(state_key(RUN), "partitions", "1")
    for group_id in group_ids:
        fields = encode(score(make_group(run=RUN, group_id=group_id)))
        plain.xadd(stream_key(RUN, 0, "scored"), fields)  # type: ignore[arg-type]


def test_sync_training_loop_with_checkpoint_and_resume(
    clients: tuple[Source, sync_redis.Redis],
) -> None:
    redis, plain = clients
    publish(plain, *(f"g{i}" for i in range(6)))
    fake = FakeVllm()
    settings = TrainerClientSettings(block_ms=50, inference_urls=("http://a:1",), new_run=True)
    with SyncTrainerClient(redis(), run=RUN, consumer="rank0", settings=settings,
                           transport=fake.transport()) as tc:
        batch = tc.next_batch(groups=2)
        assert batch.input_ids.shape[0] == 8
        assert batch.ack() == 2
        saved = tc.state()
        assert tc.publish_policy(1, "/w1") == 1 and tc.current_version() == 1
        tc.next_batch(groups=2).ack()  # lost with the crash below
    with SyncTrainerClient(redis(), run=RUN, consumer="rank0", settings=settings) as tc:
        assert tc.load_state(saved) == 2
        rest: list[str] = []
        while len(batch := tc.next_batch(groups=2, timeout_s=0.3)):
            rest += batch.group_ids
            batch.ack()
    assert rest == ["g2", "g3", "g4", "g5"]
    assert plain.hget(counters_key(RUN, 0), "consumed") == b"6"  # type: ignore[comparison-overlap]
    assert fake.calls["a"][-1] == "/resume"


def test_sync_client_must_be_opened() -> None:
    tc = SyncTrainerClient(fakeredis.aioredis.FakeRedis(), run=RUN, consumer="rank0")
    with pytest.raises(RuntimeError, match="before open"):
        tc.next_batch()
    tc.close()  # closing an unopened client is harmless
