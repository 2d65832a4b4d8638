"""A first run as the quickstart is written (issue 45): no dataset spent on a reward with no
signal, and every mistake said at once by the role the user watches. Real redis-server, the
real roles (``ops.roles``) and the real trainer client."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from rollq.ops.cli import main
from rollq.ops.roles import run_scorer
from rollq.ops.settings import ScorerSettings
from rollq.producers.feeder import Feeder, FeedPlan
from rollq.producers.publisher import Publisher
from rollq.schemas import breaker
from rollq.schemas.keys import state_key
from tests.factories import make_group
from tests.redis_server import RedisServer

SAME_LENGTH_REWARD = ("components:\n  - name: length\n    component: length_bounty\n"
                      "advantages: {zero_variance: drop}\n")


def errors_of(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == event and e["log_level"] == "error"]


def warnings_of(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == event and e["log_level"] == "warning"]


async def _publish_flat(publisher: Publisher, run: str, count: int, start: int = 0) -> None:
    for seed in range(start, start + count):
        await publisher.publish(make_group(run=run, seed=seed))  # same-length completions


def _feeder(redis: aioredis.Redis, run: str, enqueued: list[int]) -> Feeder:
    async def enqueue(position: int) -> bool:
        enqueued.append(position)
        return True

    return Feeder(redis, run, FeedPlan(dataset_size=100, epochs=1, max_staleness=1,
                                       batch_groups=8), enqueue, trip_after=10)


async def test_sixteen_zero_variance_groups_stop_admission_within_one_scoring_batch(
        real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "reward.yaml"
    config.write_text(SAME_LENGTH_REWARD)
    publisher = Publisher(real_redis, "flat")
    await publisher.register()
    await _publish_flat(publisher, "flat", 16)
    settings = ScorerSettings(redis_url=redis_server.url, run="flat", reward_config=config,
                              processes=1, concurrency=16)
    with capture_logs() as logs:
        stage = await run_scorer(settings, asyncio.Event(), burst=True)  # one read of 16
    assert stage.dropped == 16
    tripped = await breaker.read(real_redis, "flat")
    assert tripped is not None and (tripped.reason, tripped.streak) == ("zero_variance", 16)
    [error] = errors_of(logs, "admission_stopped")
    assert error["role"] == "scorer"
    assert ("the last 16 groups scored in run 'flat' were all dropped as zero-variance: every "
            "completion of a group got the same reward" in error["message"])
    assert "`rollq runs resume flat`" in error["message"]

    enqueued: list[int] = []
    feeder = _feeder(real_redis, "flat", enqueued)
    with capture_logs() as logs:
        assert await feeder.feed_once() == 0 and not enqueued  # admission stopped
    [error] = errors_of(logs, "admission_stopped")
    assert "dropped as zero-variance" in error["message"]

    assert await asyncio.to_thread(main, ["runs", "resume", "flat", "--redis-url",
                                          redis_server.url]) == 0
    assert "it had stopped after 16 groups were dropped as zero-variance" in capsys.readouterr().out
    assert await real_redis.hget(state_key("flat"), breaker.ZERO_VARIANCE_STREAK_FIELD) == b"0"
    assert await feeder.feed_once() == 16 and enqueued == list(range(16))


async def test_a_forwarded_group_restarts_the_zero_variance_streak(
        real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path) -> None:
    config = tmp_path / "reward.yaml"
    config.write_text(SAME_LENGTH_REWARD)
    publisher = Publisher(real_redis, "mixed")
    await publisher.register()
    await _publish_flat(publisher, "mixed", 10)
    await publisher.publish(make_group(run="mixed", texts=["a", "bb", "ccc", "dddd"]))
    await _publish_flat(publisher, "mixed", 10, start=10)
    settings = ScorerSettings(redis_url=redis_server.url, run="mixed", reward_config=config,
                              processes=1, concurrency=8)
    stage = await run_scorer(settings, asyncio.Event(), burst=True)
    assert (stage.forwarded, stage.dropped) == (1, 20)
    assert await breaker.read(real_redis, "mixed") is None  # 10, then 10: never 16 in a row
    assert await real_redis.hget(state_key("mixed"), breaker.ZERO_VARIANCE_STREAK_FIELD) == b"10"
    # and 0 turns it off
    await _publish_flat(publisher, "mixed", 20, start=20)
    off = settings.model_copy(update={"zero_variance_breaker": 0})
    await run_scorer(off, asyncio.Event(), burst=True)
    assert await breaker.read(real_redis, "mixed") is None
