"""The scoring consumer end to end: real Redis, real `rollq score` processes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import redis.exceptions as redis_exceptions

from rollq.consumers.bus import ReaderSettings, StreamReader, join_trajectories
from rollq.consumers.scorer import GroupScore, RewardBridge, RewardConfig, Sample, ScoringError
from rollq.consumers.scorer.consumer import Scorer
from rollq.consumers.stage import Stage
from rollq.ops.cli import Exit, main
from rollq.ops.roles import run_scorer
from rollq.ops.settings import ScorerSettings
from rollq.producers.publisher import Publisher
from rollq.schemas import ScoredGroup, decode_dead, decode_scored
from rollq.schemas.keys import counters_key, stream_key
from tests.factories import make_group
from tests.redis_server import RedisServer
from tests.waiting import until

RUN = "scoring"
GSM8K = """\
components:
  - name: accuracy
    component: accuracy
    settings: {kind: gsm8k}
  - name: format
    component: format
    weight: 0.5
    settings: {preset: think}
advantages: {method: grpo, zero_variance: drop}
pool: {workers: 1}
"""
TEXTS = ["<think>\\n6 times 7</think>#### 42", "#### 41", "<think>x</think>no", "#### 42"]


async def scored_groups(redis: aioredis.Redis, run: str = RUN) -> list[ScoredGroup]:
    """The run's scored stream, each entry joined with its trajectory and decoded."""
    key = stream_key(run, 0, "scored")
    joined = await join_trajectories(redis, [(key, f) for _, f in await redis.xrange(key)])
    assert not any(isinstance(f, str) for f in joined), joined
    return [decode_scored(f) for f in joined if not isinstance(f, str)]


async def publish(redis: aioredis.Redis, count: int, prefix: str = "g") -> None:
    publisher = Publisher(redis, RUN)
    for i in range(count):
        await publisher.publish(make_group(run=RUN, group_id=f"{prefix}{i}", texts=TEXTS,
                                           metadata={"answer": "42"}))


async def test_scorer_scores_forwards_and_dead_letters(
    real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = tmp_path / "reward.yaml"
    config.write_text(GSM8K.replace("\\\\", "\\"))
    await publish(real_redis, 3)
    await Publisher(real_redis, RUN).publish(make_group(run=RUN, group_id="no-gold",
                                                        metadata={"question": "?"}))
    await Publisher(real_redis, RUN).publish(make_group(run=RUN, group_id="flat",
                                                        texts=["#### 1"] * 4,
                                                        metadata={"answer": "42"}))
    settings = ScorerSettings(redis_url=redis_server.url, run=RUN, reward_config=config,
                              processes=1)
    stage = await run_scorer(settings, asyncio.Event(), burst=True)
    assert (stage.forwarded, stage.dropped, stage.dead_lettered) == (3, 1, 1)
    group = (await scored_groups(real_redis))[0]
    assert [s.components["accuracy"] for s in group.scores] == [1.0, 0.0, 0.0, 1.0]
    assert [s.components["format"] for s in group.scores] == [1.0, 0.0, 1.0, 0.0]
    assert [s.reward for s in group.scores] == [1.5, 0.0, 0.5, 1.0]
    assert group.scores[0].advantage > group.scores[3].advantage > group.scores[1].advantage
    assert group.weights == {"accuracy": 1.0, "format": 0.5}
    (dead,) = [decode_dead(f) for _, f in await real_redis.xrange(stream_key(RUN, 0, "dead"))]
    assert dead.reason == "reward_missing_field" and "'answer'" in dead.detail
    counters = await real_redis.hgetall(counters_key(RUN, 0))
    assert counters[b"drop:zero_variance"] == b"1" and counters[b"scored"] == b"3"


async def test_killed_scorer_entries_are_reclaimed_and_forwarded_once(
    real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Scorer A takes entries and hangs in a reward; it is killed. Scorer B reclaims them."""
    hanging = tmp_path / "hang.yaml"
    hanging.write_text("components:\n  - name: nap\n"
                       "    component: tests.scorer.custom_components:Nap\n"
                       "    settings: {seconds: 60}\n    timeout_s: 120\n"
                       "advantages: {zero_variance: keep}\npool: {workers: 1}\n")
    publisher = Publisher(real_redis, RUN)
    for i in range(12):
        await publisher.publish(make_group(run=RUN, group_id=f"nap{i}", texts=["nap"] * 4))
    environment = {**os.environ, "ROLLQ_REDIS_URL": redis_server.url, "ROLLQ_RUN": RUN,
                   "ROLLQ_RECLAIM_IDLE_S": "2", "ROLLQ_LOG_FORMAT": "json"}
    scorer_a = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq", "score", "--reward-config", str(hanging),
        "--consumer", "scorer-a", "--concurrency", "16", env=environment,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)

    async def a_took_all() -> bool:
        groups = await real_redis.xinfo_groups(stream_key(RUN, 0, "traj"))
        return bool(groups) and groups[0]["pending"] == 12

    await until(a_took_all, "scorer A to take the entries")
    scorer_a.send_signal(signal.SIGKILL)
    await scorer_a.wait()
    assert await real_redis.xlen(stream_key(RUN, 0, "scored")) == 0

    quick = tmp_path / "quick.yaml"
    quick.write_text("components:\n  - name: length\n    component: length_bounty\n"
                     "advantages: {zero_variance: keep}\n")
    await asyncio.sleep(2.5)  # past reclaim_idle_s
    settings = ScorerSettings(redis_url=redis_server.url, run=RUN, reward_config=quick,
                              consumer="scorer-b", reclaim_idle_s=2)
    stop = asyncio.Event()
    task = asyncio.create_task(run_scorer(settings, stop))
    await until(lambda: _scored_at_least(real_redis, 12), "scorer B to score all 12")
    await asyncio.sleep(0.5)  # room for a duplicate to show, if one were coming
    stop.set()
    await asyncio.wait_for(task, 30)
    ids = [g.group_id for g in await scored_groups(real_redis)]
    assert sorted(ids) == sorted(f"nap{i}" for i in range(12))  # each exactly once
    assert (await real_redis.xpending(stream_key(RUN, 0, "traj"), "scorers"))["pending"] == 0


async def test_two_scorers_share_the_work(real_redis: aioredis.Redis,
                                          redis_server: RedisServer) -> None:
    await publish(real_redis, 40)
    stops = [asyncio.Event(), asyncio.Event()]
    tasks = [asyncio.create_task(run_scorer(ScorerSettings(
        redis_url=redis_server.url, run=RUN, consumer=f"s{i}", processes=1), stops[i]))
        for i in range(2)]
    await until(lambda: _scored_at_least(real_redis, 40), "the scorers to score all 40")
    for stop in stops:
        stop.set()
    stages = await asyncio.gather(*tasks)
    assert sum(s.forwarded for s in stages) == 40
    assert all(s.forwarded > 0 for s in stages), "both scorers took a share"
    assert await real_redis.xlen(stream_key(RUN, 0, "scored")) == 40


async def test_rescore_replays_into_another_run(
    real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await publish(real_redis, 5)
    await run_scorer(ScorerSettings(redis_url=redis_server.url, run=RUN, processes=1),
                     asyncio.Event(), burst=True)
    alternative = tmp_path / "b.yaml"
    alternative.write_text("components:\n  - name: length\n    component: length_bounty\n"
                           "    settings: {scale: 10, max: 5}\n"
                           "advantages: {zero_variance: keep}\n")
    code = await asyncio.to_thread(main, [
        "rescore", "--redis-url", redis_server.url, "--run", RUN, "--reward-config",
        str(alternative), "--into", "scoring-b"], {})
    assert code == Exit.OK
    assert "rescored into run 'scoring-b': 5 scored, 0 dead, 0 dropped" in capsys.readouterr().err
    rescored = await scored_groups(real_redis, "scoring-b")  # written inline: no join
    assert len(rescored) == 5 and all(g.trajectory.run == "scoring-b" for g in rescored)
    assert list(rescored[0].scores[0].components) == ["length"]
    assert rescored[0].scores[0].reward == pytest.approx(len(TEXTS[0].replace("\\\\", "\\")) / 10)
    assert await real_redis.xlen(stream_key(RUN, 0, "scored")) == 5  # the original is untouched


def test_score_with_a_bad_config_fails_at_start_up(
    tmp_path: Path, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("components:\n  - name: r\n    component: repetition\n"
                      "    settings: {max_penalty: 1.0}\n")
    assert main(["score", "--redis-url", redis_server.url, "--run", RUN, "--reward-config",
                 str(config), "--burst"], {}) == Exit.CONFIG
    err = capsys.readouterr().err
    assert "max_penalty" in err


async def test_scorer_trims_acked_entries_of_both_streams(
    real_redis: aioredis.Redis, redis_server: RedisServer
) -> None:
    await publish(real_redis, 4)
    scored_key = stream_key(RUN, 0, "scored")
    await real_redis.xgroup_create(scored_key, "trainer", id="0", mkstream=True)
    stop = asyncio.Event()
    settings = ScorerSettings(redis_url=redis_server.url, run=RUN, processes=1, retention_s=0,
                              block_ms=20, trim_every_s=0.05)
    task = asyncio.create_task(run_scorer(settings, stop))
    await until(lambda: _scored_at_least(real_redis, 4), "all 4 groups scored")
    await asyncio.sleep(0.2)  # trim rounds run (every 0.05 s): nothing may go yet
    traj_key = stream_key(RUN, 0, "traj")
    # The scorers acked every traj entry, but the scored entries name them and the trainer
    # has consumed none: both streams are kept whole.
    assert await real_redis.xlen(traj_key) == 4
    assert await real_redis.xlen(scored_key) == 4
    taken = await real_redis.xreadgroup("trainer", "t", {scored_key: ">"}, count=3)
    await real_redis.xack(scored_key, "trainer", *[i for i, _ in taken[0][1]])

    async def trimmed() -> bool:
        return await real_redis.xlen(scored_key) == 1 and await real_redis.xlen(traj_key) == 1

    await until(trimmed, "the consumed groups to be trimmed")
    stop.set()
    await asyncio.wait_for(task, 30)
    assert await real_redis.xlen(scored_key) == 1  # only the unread group is left
    assert await real_redis.xlen(traj_key) == 1  # and the trajectory it names
    assert len(await scored_groups(real_redis)) == 1


async def test_a_trim_redis_refuses_does_not_stop_the_scorer(
    real_redis: aioredis.Redis, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused: list[int] = []

    async def refusing(*args: object, **kwargs: object) -> int:
        refused.append(1)
        raise redis_exceptions.ResponseError("ERR Invalid stream ID specified as stream")

    monkeypatch.setattr("rollq.ops.roles.trim_streams", refusing)
    stop = asyncio.Event()
    settings = ScorerSettings(redis_url=redis_server.url, run=RUN, processes=1, block_ms=20,
                              trim_every_s=0.05)
    task = asyncio.create_task(run_scorer(settings, stop))
    await until(lambda: len(refused) >= 3, "three refused trims")
    await publish(real_redis, 2)
    await until(lambda: _scored_at_least(real_redis, 2), "groups scored after the refusals")
    assert not task.done()
    stop.set()
    await asyncio.wait_for(task, 30)


BATCH_SCOPED = {
    "components": [
        {"name": "accuracy", "component": "accuracy", "settings": {"kind": "gsm8k"}},
        {"name": "by_batch", "component": "length", "settings": {"scope": "batch"}},
    ],
    "advantages": {"zero_variance": "keep"},
}


async def test_batch_scoped_rewards_score_each_read_together(redis: aioredis.Redis) -> None:
    """`scope: batch` under the real Stage: one bridge call per read, each group still
    forwarded or dead-lettered on its own."""
    publisher = Publisher(redis, RUN)
    for group_id, texts, metadata in [
            ("a", ["#### 42", "#### 41" + "x" * 20], {"answer": "42"}),
            ("no-gold", ["#### 1", "#### 2"], {"question": "?"}),
            ("b", ["#### 42" + "y" * 50, "#### 1"], {"answer": "42"})]:
        await publisher.publish(make_group(run=RUN, group_id=group_id, group_size=2,
                                           texts=texts, metadata=metadata))
    async with RewardBridge(RewardConfig.from_mapping(BATCH_SCOPED)) as bridge:
        calls: list[int] = []
        score_groups = bridge.score_groups

        async def counted(groups: Sequence[Sequence[Sample]]) -> list[GroupScore | ScoringError]:
            calls.append(len(groups))
            return await score_groups(groups)

        bridge.score_groups = counted  # type: ignore[method-assign]  # a spy, for this test
        scorer = Scorer(bridge, "batch", redis)
        assert scorer.batch_transform is not None
        stage = Stage(StreamReader(redis, [stream_key(RUN, 0, "traj")], "scorers", "s1",
                                   ReaderSettings(block_ms=20)), scorer)
        await stage.drain()
    assert calls == [3]  # one call for the read (the group without gold fails on its own)
    assert (stage.forwarded, stage.dead_lettered) == (2, 1)
    (letter,) = [decode_dead(f) for _, f in await redis.xrange(stream_key(RUN, 0, "dead"))]
    assert letter.reason == "reward_missing_field"
    groups = {g.group_id: g for g in await scored_groups(redis)}
    # Lengths over the batch of both scored groups: 7, 27, 57, 6 chars (min 6, max 57).
    assert [s.components["by_batch"] for s in groups["a"].scores] == pytest.approx(
        [0.5 - 1 / 51, min(0.0, 0.5 - 21 / 51)])
    assert [s.components["by_batch"] for s in groups["b"].scores] == pytest.approx(
        [0.5 - 51 / 51, 0.0])


async def _scored_at_least(redis: aioredis.Redis, count: int) -> bool:
    return int(await redis.xlen(stream_key(RUN, 0, "scored"))) >= count
