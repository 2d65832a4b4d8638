"""``rollq rescore`` on a real redis-server: nothing lost, nothing silent, batch scope."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aioredis

from rollq.consumers.bus import join_trajectories
from rollq.ops.rescore import RESCORE_GROUP, rescore
from rollq.ops.settings import ScorerSettings
from rollq.producers.publisher import Publisher
from rollq.schemas import decode_dead, decode_scored, decode_trajectory
from rollq.schemas.failures import DECODE_ERROR, REWARD_ERROR
from rollq.schemas.keys import counters_key, stream_key
from tests.factories import make_group
from tests.redis_server import RedisServer

SOURCE, TARGET = "source", "target"
BOOM = """\
components:
  - name: boom
    component: tests.scorer.custom_components:Boom
  - name: length
    component: length_bounty
    settings: {scale: 10, max: 5}
advantages: {zero_variance: keep}
"""
BATCH = """\
components:
  - name: accuracy
    component: accuracy
    settings: {kind: gsm8k}
  - name: by_batch
    component: length
    settings: {scope: batch}
advantages: {zero_variance: keep}
"""


def settings(redis_server: RedisServer, tmp_path: Path, reward: str) -> ScorerSettings:
    path = tmp_path / "reward.yaml"
    path.write_text(reward)
    return ScorerSettings(redis_url=redis_server.url, run=SOURCE, reward_config=path)


async def scored(redis: aioredis.Redis) -> dict[str, list[float | None]]:
    """The target's scored groups (inline form), as {group_id: [length component]}."""
    key = stream_key(TARGET, 0, "scored")
    joined = await join_trajectories(redis, [(key, f) for _, f in await redis.xrange(key)])
    groups = [decode_scored(f) for f in joined if not isinstance(f, str)]
    assert all(g.trajectory.run == TARGET for g in groups)
    return {g.group_id: [s.components.get("length", s.components.get("by_batch"))
                         for s in g.scores] for g in groups}


async def test_rescore_dead_letters_what_it_cannot_decode_or_score_and_goes_on(
    real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    publisher = Publisher(real_redis, SOURCE)
    await publisher.publish(make_group(run=SOURCE, group_id="g0", group_size=2,
                                       texts=["ab", "abcd"]))
    garbage_id = await real_redis.xadd(stream_key(SOURCE, 0, "traj"), {b"x": b"\x00\xff"})
    await publisher.publish(make_group(run=SOURCE, group_id="bad", group_size=2,
                                       texts=["boom", "fine"]))
    for i in (1, 2):
        await publisher.publish(make_group(run=SOURCE, group_id=f"g{i}", group_size=2,
                                           texts=["a" * i, "b" * (i + 2)]))
    lines: list[str] = []
    result = await rescore(settings(redis_server, tmp_path, BOOM), TARGET,
                           progress=lines.append, batch=2, attempts=2)
    assert (result.seen, result.scored, result.dead, result.dropped) == (5, 3, 2, 0)
    assert lines[-1] == "rescored 5/5 groups: 3 scored, 2 dead, 0 dropped"
    assert len(lines) == 3  # one line per batch of 2
    assert await scored(real_redis) == {"g0": [0.2, 0.4], "g1": [0.1, 0.3],
                                        "g2": [0.2, 0.4]}
    letters = {decode_dead(f).reason: decode_dead(f)
               for _, f in await real_redis.xrange(stream_key(TARGET, 0, "dead"))}
    assert set(letters) == {DECODE_ERROR, REWARD_ERROR}
    undecodable = letters[DECODE_ERROR]
    assert undecodable.source_id == garbage_id.decode()
    assert undecodable.source_stream == stream_key(SOURCE, 0, "traj")
    assert undecodable.payload == {b"x": b"\x00\xff"}
    failed = letters[REWARD_ERROR]
    assert "'boom'" in failed.detail and "after 2 tries" in failed.detail
    assert failed.consumer_group == RESCORE_GROUP and failed.deliveries == 2
    assert decode_trajectory(failed.payload).group_id == "bad"  # requeueable as it was
    counters = await real_redis.hgetall(counters_key(TARGET, 0))
    assert counters == {b"scored": b"3", b"drop:decode_error": b"1", b"drop:reward_error": b"1"}
    # The source run is untouched.
    assert await real_redis.xlen(stream_key(SOURCE, 0, "traj")) == 5
    assert not await real_redis.exists(stream_key(SOURCE, 0, "dead"))


async def test_rescore_honours_batch_scope(
    real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    publisher = Publisher(real_redis, SOURCE)
    await publisher.publish(make_group(run=SOURCE, group_id="a", group_size=2,
                                       texts=["#### 42", "#### 41" + "x" * 20],
                                       metadata={"answer": "42"}))
    await publisher.publish(make_group(run=SOURCE, group_id="b", group_size=2,
                                       texts=["#### 42" + "y" * 50, "#### 1"],
                                       metadata={"answer": "42"}))
    result = await rescore(settings(redis_server, tmp_path, BATCH), TARGET,
                           progress=lambda line: None)
    assert (result.scored, result.dead) == (2, 0)
    # Over both groups (lengths 7, 27, 57, 6), not within each.
    assert await scored(real_redis) == {
        "a": pytest.approx([0.5 - 1 / 51, min(0.0, 0.5 - 21 / 51)]),
        "b": pytest.approx([-0.5, 0.0])}
