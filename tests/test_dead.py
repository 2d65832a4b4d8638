"""``rollq dead list | show | requeue`` on a real redis-server: scoring and rollout failures
go back where they failed, counters follow, a double requeue is one, and the trainer never
sees a requeued group twice."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from consumers.bus import Delivery, StreamReader
from consumers.trainer import TrainerClient
from ops.cli import Exit, main
from ops.dead import letters, parse_time, requeue
from ops.roles import run_scorer
from ops.settings import ScorerSettings
from producers.publisher import Publisher
from producers.worker import connect_queue, enqueue_rollout, job_id
from schemas import ContractError, decode_trajectory, encode
from schemas.keys import counters_key, stream_key
from tests.factories import make_group
from tests.producers.fake_vllm import FakeVLLM
from tests.producers.test_job_failures import FlakyEnv, worker
from tests.redis_server import RedisServer
from tests.trainer.helpers import FAST

RUN = "deadrun"
NEEDS_GOLD = ("components:\n  - name: accuracy\n    component: accuracy\n"
              "    settings: {kind: gsm8k}\nadvantages: {zero_variance: keep}\n")
NO_GOLD = ("components:\n  - name: length\n    component: length_bounty\n"
           "advantages: {zero_variance: keep}\n")


async def score(url: str, config: Path) -> None:
    await run_scorer(ScorerSettings(redis_url=url, run=RUN, reward_config=config,
                                    processes=1), asyncio.Event(), burst=True)


async def counters(redis: aioredis.Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await redis.hgetall(counters_key(RUN, 0))).items()}


async def test_requeue_a_scoring_failure_after_fixing_the_config(
        real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path) -> None:
    (tmp_path / "gold.yaml").write_text(NEEDS_GOLD)
    (tmp_path / "plain.yaml").write_text(NO_GOLD)
    for i in range(3):  # no gold answer in the metadata: dead-lettered as missing field
        await Publisher(real_redis, RUN).publish(
            make_group(run=RUN, group_id=f"g{i}", metadata={"q": "?"}))
    await score(redis_server.url, tmp_path / "gold.yaml")
    dead = await letters(real_redis, RUN)
    assert [d.letter.reason for d in dead] == ["reward_missing_field"] * 3
    assert (await counters(real_redis))["drop:reward_missing_field"] == 3

    chosen = [d for d in dead if d.group_id == "g1"]
    outcome = await requeue(real_redis, redis_server.url, RUN, chosen)
    assert "re-added to" in outcome[0][1]
    assert [d.group_id for d in await letters(real_redis, RUN)] != ["g1"]
    assert {d.group_id for d in await letters(real_redis, RUN)} == {"g0", "g2"}
    state = await counters(real_redis)
    assert state["drop:reward_missing_field"] == 2 and state["requeued"] == 1
    await score(redis_server.url, tmp_path / "plain.yaml")  # the fixed reward config
    assert await real_redis.xlen(stream_key(RUN, 0, "scored")) == 1
    assert (await counters(real_redis))["scored"] == 1


async def test_requeue_twice_at_once_requeues_once(
        real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path) -> None:
    (tmp_path / "gold.yaml").write_text(NEEDS_GOLD)
    await Publisher(real_redis, RUN).publish(make_group(run=RUN, group_id="g", metadata={"q": 1}))
    await score(redis_server.url, tmp_path / "gold.yaml")
    dead = await letters(real_redis, RUN)
    traj_before = await real_redis.xlen(stream_key(RUN, 0, "traj"))
    outcomes = await asyncio.gather(*(requeue(real_redis, redis_server.url, RUN, dead)
                                      for _ in range(4)))
    assert sum("re-added" in o[0][1] for o in outcomes) == 1
    assert await real_redis.xlen(stream_key(RUN, 0, "traj")) == traj_before + 1
    assert (await counters(real_redis))["requeued"] == 1


async def test_requeue_a_rollout_failure_runs_the_job_again(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    broken = FlakyEnv(lambda index, call: (_ for _ in ()).throw(ContractError("bad item")))
    await Publisher(real_redis, RUN).register()
    queue = await connect_queue(redis_server.url)
    await enqueue_rollout(queue, RUN, broken.name, 5)
    await queue.aclose()
    await real_redis.hincrby(f"rollq:{{{RUN}}}:state", "admitted", 1)
    await _drain(worker(redis_server.url, broken, FakeVLLM(), run=RUN))
    (dead,) = await letters(real_redis, RUN)
    assert dead.is_job and dead.letter.reason == "contract_error"
    assert (await counters(real_redis))["drop:contract_error"] == 1

    [(_, outcome)] = await requeue(real_redis, redis_server.url, RUN, [dead])
    assert outcome == "job enqueued"
    await _drain(worker(redis_server.url, FlakyEnv(lambda index, call: None), FakeVLLM(),
                        run=RUN))
    (entry,) = await real_redis.xrange(stream_key(RUN, 0, "traj"))
    assert decode_trajectory(entry[1]).group_id == job_id(RUN, "gsm8k", 5)  # same group id
    assert await letters(real_redis, RUN) == []
    state = await counters(real_redis)
    assert state["drop:contract_error"] == 0 and state["requeued"] == 1


async def test_a_requeued_copy_of_a_trained_group_is_not_trained_again(
        real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path) -> None:
    (tmp_path / "plain.yaml").write_text(NO_GOLD)
    group = make_group(run=RUN, group_id="once")
    await Publisher(real_redis, RUN).publish(group)
    await score(redis_server.url, tmp_path / "plain.yaml")
    async with trainer_client(real_redis) as trainer:
        batch = await trainer.next_batch(groups=1, timeout_s=5)
        assert batch.group_ids == ["once"]
        await trainer.ack(batch)
    # A re-run of its job published a second copy, which got dead-lettered; requeue it.
    traj = stream_key(RUN, 0, "traj")
    copy_id = (await real_redis.xadd(traj, encode(group))).decode()  # type: ignore[arg-type]
    reader = StreamReader(real_redis, [traj], "scorers", "someone")
    await reader.read()
    await reader.dead_letter(Delivery(traj, copy_id, encode(group), 1), "unexpected_error", "x")
    (dead,) = await letters(real_redis, RUN)
    await requeue(real_redis, redis_server.url, RUN, [dead])
    await score(redis_server.url, tmp_path / "plain.yaml")
    async with trainer_client(real_redis) as trainer:
        again = await trainer.next_batch(groups=1, timeout_s=1)
    assert again.group_ids == []  # the requeued copy was dropped as a duplicate
    assert (await counters(real_redis))["drop:duplicate"] == 1


async def test_the_cli(real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path,
                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "gold.yaml").write_text(NEEDS_GOLD)
    for i in range(2):
        await Publisher(real_redis, RUN).publish(
            make_group(run=RUN, group_id=f"c{i}", metadata={"q": 1}))
    await score(redis_server.url, tmp_path / "gold.yaml")
    flags = ["--redis-url", redis_server.url, "--run", RUN]
    capsys.readouterr()  # the scorer's log lines
    assert await _main(["dead", "list", "--json", *flags]) == Exit.OK
    listed = json.loads(capsys.readouterr().out)
    assert {d["group_id"] for d in listed} == {"c0", "c1"}
    assert {d["reason"] for d in listed} == {"reward_missing_field"}
    assert await _main(["dead", "list", "--reason", "decode_error", *flags]) == Exit.OK
    assert "no dead letters" in capsys.readouterr().out
    first = listed[0]["id"]
    assert await _main(["dead", "show", first, *flags]) == Exit.OK
    shown = capsys.readouterr().out
    assert "reward_missing_field" in shown and "traj group" in shown
    assert await _main(["dead", "show", "1-1", *flags]) == Exit.NOT_FOUND
    assert await _main(["dead", "requeue", "--all", "--dry-run", *flags]) == Exit.OK
    assert "2 dead letter(s) to requeue" in capsys.readouterr().out
    assert len(await letters(real_redis, RUN)) == 2  # the dry run changed nothing
    assert await _main(["dead", "requeue", first, *flags]) == Exit.USAGE  # no tty, no --yes
    assert await _main(["dead", "requeue", first, "--yes", *flags]) == Exit.OK
    assert len(await letters(real_redis, RUN)) == 1
    assert await _main(["dead", "list", "--run", "nope", "--redis-url", redis_server.url]) \
        == Exit.NOT_FOUND


def test_parse_time() -> None:
    assert parse_time("30m", now=10_000) == 10_000 - 1800
    assert parse_time("2h", now=10_000) == 10_000 - 7200
    assert parse_time("2026-01-01T00:00:00+00:00") == 1767225600
    with pytest.raises(ValueError, match="neither"):
        parse_time("yesterday")


def trainer_client(redis: aioredis.Redis) -> TrainerClient:
    return TrainerClient(redis, run=RUN, consumer="rank0", settings=FAST)


async def _drain(arq_worker: Any) -> None:
    try:
        await asyncio.wait_for(arq_worker.main(), 60)
    finally:
        await arq_worker.close()


async def _main(argv: list[str]) -> int:
    return await asyncio.to_thread(main, argv, {})


def test_stream_letters_older_than_the_dedup_window_are_not_requeued() -> None:
    from ops.dead import Letter, too_old
    from schemas import DeadLetter

    def letter(source_stream: str, source_id: str) -> Letter:
        return Letter("rollq:{r:0}:dead", "1-0", DeadLetter(
            reason="unexpected_error", source_stream=source_stream, source_id=source_id,
            consumer_group="scorers"))

    now = 1_000_000.0
    fresh = letter("rollq:{r:0}:traj", f"{int((now - 3600) * 1000)}-0")
    old = letter("rollq:{r:0}:traj", f"{int((now - 6 * 3600) * 1000)}-0")
    job = letter("jobs:r", "r:gsm8k:3")
    assert not too_old(fresh, 6 * 3600, now)
    assert too_old(old, 6 * 3600, now)
    assert not too_old(job, 6 * 3600, now)  # a dead job never published its group
