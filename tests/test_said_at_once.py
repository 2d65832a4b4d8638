"""A first run as the quickstart is written (issue 45): no dataset spent on a reward with no
signal, and every mistake said at once by the role the user watches. Real redis-server, the
real roles (``ops.roles``) and the real trainer client."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from rollq.consumers.trainer import TrainerClient, TrainerClientSettings
from rollq.ops.cli import main
from rollq.ops.roles import run_feeder, run_scorer, run_workers
from rollq.ops.settings import FeederSettings, ScorerSettings, WorkerSettings
from rollq.producers.feeder import Feeder, FeedPlan
from rollq.producers.publisher import Publisher
from rollq.schemas import breaker
from rollq.schemas.keys import state_key
from tests.factories import make_group
from tests.producers.fake_vllm import FakeVLLM, fake_transport
from tests.redis_server import RedisServer
from tests.test_watchdog import SAME_LENGTH_REWARD, logged, role
from tests.trainer.helpers import FakeVllm
from tests.waiting import until


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
    [error] = logged(logs, "admission_stopped", "error")
    assert error["role"] == "scorer"
    assert ("the last 16 groups scored in run 'flat' were all dropped as zero-variance: every "
            "completion of a group got the same reward" in error["message"])
    assert "`rollq runs resume flat`" in error["message"]

    enqueued: list[int] = []
    feeder = _feeder(real_redis, "flat", enqueued)
    with capture_logs() as logs:
        assert await feeder.feed_once() == 0 and not enqueued  # admission stopped
    [error] = logged(logs, "admission_stopped", "error")
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


async def test_a_run_typo_is_said_at_start_up_by_workers_scorer_and_trainer(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    """Default settings (stall_warning_s 300): the WARNING comes at start-up, within 5 s."""
    await Publisher(real_redis, "gsm8k-grpo").register()
    fake = FakeVLLM()
    workers = WorkerSettings(redis_url=redis_server.url, run="gsm8k-gpro",
                             inference=[fake.base_url], model=fake.model)
    scorer = ScorerSettings(redis_url=redis_server.url, run="gsm8k-gpro", processes=1)
    with capture_logs() as logs:
        started = time.monotonic()
        async with role(run_workers(workers, transport=fake_transport(fake))), \
                role(run_scorer(scorer, asyncio.Event())):
            await until(lambda: len(logged(logs, "run_not_found_at_start")) == 2,
                        "the unknown-run warnings of workers and scorer", timeout_s=5)
            assert time.monotonic() - started < 5
            await asyncio.sleep(0.5)  # no second line
    warnings = {w["role"]: w for w in logged(logs, "run_not_found_at_start")}
    assert set(warnings) == {"workers", "scorer"}
    for name, noun in (("workers", "worker pool"), ("scorer", "scorer")):
        assert warnings[name]["known_runs"] == ["gsm8k-grpo"]
        message = warnings[name]["message"]
        assert f"run 'gsm8k-gpro' did not exist when this {noun} started" in message
        assert "known runs: gsm8k-grpo: a typo in --run?" in message
        assert "A run comes to exist when a role registers it (its feeder: `rollq feed --run " \
            "gsm8k-gpro`" in message


async def test_a_trainer_on_a_run_typo_warns_at_once_and_publishes_nothing(
        real_redis: aioredis.Redis) -> None:
    await Publisher(real_redis, "gsm8k-grpo").register()
    fake = FakeVllm()
    settings = TrainerClientSettings(inference_urls=("http://gpu0:8000",), block_ms=50)
    with capture_logs() as logs:
        async with TrainerClient(real_redis, run="gsm8k-gpro", consumer="t", settings=settings,
                                 transport=fake.transport()) as trainer:
            [warning] = logged(logs, "run_not_found_at_start")
            assert await trainer.publish_policy(0, "/ckpt/step-0") == 0
            assert await trainer.publish_policy(1, "/ckpt/step-1") == 0
            assert not fake.calls  # the servers (maybe another run's) were left alone
            # once another role works on the run, its weights go out
            await Publisher(real_redis, "gsm8k-gpro").publish(make_group(run="gsm8k-gpro"))
            assert await trainer.publish_policy(2, "/ckpt/step-2") == 2
    assert warning["role"] == "trainer" and warning["known_runs"] == ["gsm8k-grpo"]
    assert "run 'gsm8k-gpro' did not exist when this trainer started" in warning["message"]
    assert "sends no weights to its inference servers" in warning["message"]
    skipped = logged(logs, "policy_not_published")
    assert [w["step"] for w in skipped] == [0, 1]
    assert "pass new_run=True (--new-run)" in skipped[0]["message"]
    assert fake.calls["gpu0"] and fake.bodies[("gpu0", "/collective_rpc")] == {
        "method": "reload_weights", "kwargs": {"weights_path": "/ckpt/step-2"}}


async def test_a_trainer_told_it_starts_a_new_run_publishes_at_once(
        real_redis: aioredis.Redis) -> None:
    fake = FakeVllm()
    settings = TrainerClientSettings(inference_urls=("http://gpu0:8000",), new_run=True)
    with capture_logs() as logs:
        async with TrainerClient(real_redis, run="fresh", consumer="t", settings=settings,
                                 transport=fake.transport()) as trainer:
            assert await trainer.publish_policy(0, "/ckpt/step-0") == 0
    assert fake.calls["gpu0"] and not logged(logs, "run_not_found_at_start")


async def test_a_trainer_batch_larger_than_the_feeders_is_named_at_start_up_and_while_waiting(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    """Trainer 16, feeder 4 (max_staleness 2): the feeder admits 12 before the first step."""
    feed = FeederSettings(redis_url=redis_server.url, run="mismatch", batch_groups=4,
                          max_staleness=2, poll_s=0.05)
    settings = TrainerClientSettings(block_ms=50, reclaim_every_s=3600.0, wait_log_s=0.2,
                                     batch_groups=16)
    with capture_logs() as logs:
        async with role(run_feeder(feed, asyncio.Event())):
            await until(lambda: any(e["event"] == "feeder_started" for e in logs), "the feeder")
            await until(lambda: real_redis.hget(state_key("mismatch"), "feed_batch_groups"),
                        "the feeder's recorded settings")
            started = time.monotonic()
            async with TrainerClient(real_redis, run="mismatch", consumer="t",
                                     settings=settings) as trainer:
                assert logged(logs, "batch_groups_exceed_admission")  # at start-up
                assert time.monotonic() - started < 5
                async with role(trainer.next_batch()):
                    await until(lambda: len(logged(
                        logs, "batch_groups_exceed_admission")) >= 2, "the warning again")
    first = logged(logs, "batch_groups_exceed_admission")[0]
    assert (first["trainer_batch_groups"], first["feed_batch_groups"],
            first["stalls_at_step"]) == (16, 4, 1)
    assert ("this trainer takes 16 groups a step but the run's feeder admits 4 a step"
            in first["message"])
    assert ("run `rollq feed` with --batch-groups 16, or this trainer with --batch-groups 4"
            in first["message"])


def test_the_step_a_batch_mismatch_stalls_at() -> None:
    from rollq.consumers.trainer.waiting import stalled_step

    assert stalled_step(16, 4, 2) == 1  # 12 admitted before step 1 needs 16
    assert stalled_step(8, 4, 2) == 3  # 12, 16, 20 admitted: steps 1, 2 take 16; 3 needs 24
    assert stalled_step(9, 8, 0) == 1


def test_the_example_trainers_help_gives_help_and_defaults_for_the_first_flags() -> None:
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[1] / "examples" / "grpo_trainer.py"
    out = subprocess.run([sys.executable, str(example), "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    flat = " ".join(out.split())
    assert "--run RUN the run to train on [ROLLQ_RUN, else default]" in flat
    assert "--steps STEPS optimizer steps to train, then stop [60]" in flat
    assert "the feeder's --batch-groups must be at least this [8]" in flat
    assert "--max-staleness MAX_STALENESS drop groups more than this many policy" in flat
    assert "--new-run this trainer starts a new run" in flat


class HungAgent:
    """An agent that ignores the cancellation of its task (a blocking harness, a retry loop
    that swallows it) and stops only when its episode is gone from the gateway, or after
    ``give_up_s``."""

    def __init__(self, hub: Any, give_up_s: float) -> None:
        self.hub = hub
        self.give_up_s = give_up_s

    async def run(self, data: dict[str, Any], *, base_url: str, http_client: Any,
                  api_key: str) -> Any:
        episode_id = base_url.rstrip("/").split("/")[-2]
        ends = time.monotonic() + self.give_up_s
        while episode_id in self.hub.episodes and time.monotonic() < ends:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.01)
        raise RuntimeError("the episode is gone")


async def test_a_hung_agents_gateway_episodes_close_within_a_second_of_its_job_timeout(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    from rollq.producers.envs.episode import GatewayEpisodeEnv
    from rollq.producers.inference.capture import CaptureHub
    from rollq.producers.inference.capture.gateways import CaptureTransport, RemoteGateway
    from tests.producers.test_job_failures import RUN, dead_letters, run_positions

    hub = CaptureHub(upstream=None)  # type: ignore[arg-type]  # no call reaches upstream
    gateway = RemoteGateway("http://gateway:8090", transport=CaptureTransport(hub))
    env = GatewayEpisodeEnv(name="hung", workflow=HungAgent(hub, give_up_s=20.0),
                            records=[{"question": "1+1"}], gateway=gateway)
    counts: list[tuple[float, int]] = []

    async def health() -> None:
        while True:
            counts.append((time.monotonic(), len(hub.episodes)))  # what /health counts
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(health())
    try:
        await run_positions(redis_server.url, real_redis, env, [0], job_timeout_s=1.0,
                            timeout_margin_s=1.0, max_tries=1)
    finally:
        watcher.cancel()
    # a last look: the episodes may close and the worker stop between two of the
    # watcher's looks (its time is then an upper bound of the close)
    counts.append((time.monotonic(), len(hub.episodes)))
    opened = next(t for t, n in counts if n > 0)  # the job's start, to a few ms
    closed = next(t for t, n in counts if t > opened and n == 0)
    assert closed - opened < 1.0 + 1.0, (closed - opened)  # its timeout, then under 1 s
    [(reason, detail)] = (await dead_letters(real_redis)).values()
    assert reason == "job_timeout" and "ran past the 1 s job timeout" in detail
    assert RUN and hub.closed == 2 and not hub.episodes


async def test_tail_into_a_pipe_shows_each_entry_as_it_arrives(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    """``rollq tail traj | cat``: stdout is a pipe, not a terminal."""
    import os
    import sys

    publisher = Publisher(real_redis, "piped")
    await publisher.register()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq", "tail", "traj", "--run", "piped", "--redis-url",
        redis_server.url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": ""})
    assert process.stdout is not None
    try:
        await until(lambda: real_redis.client_list(), "the tail's connection")
        lines: list[bytes] = []
        for seed in range(2):  # each one shows before the next is published
            await until(lambda: _tail_connected(real_redis), "the tail's read", timeout_s=60)
            await publisher.publish(make_group(run="piped", seed=seed, texts=["a", "b", "c",
                                                                              "d"]))
            line = await asyncio.wait_for(process.stdout.readline(), 30)
            while b"group=" not in line:
                lines.append(line)
                line = await asyncio.wait_for(process.stdout.readline(), 30)
            lines.append(line)
        assert sum(b"group=" in line for line in lines) == 2
    finally:
        process.terminate()
        await process.wait()


async def _tail_connected(redis: aioredis.Redis) -> bool:
    return any(client.get("cmd") == "xread" for client in await redis.client_list())


async def test_status_tells_workers_waiting_for_inference_from_dead_ones_and_scored_from_drops(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    from rollq.ops.status import collect_status, render_status

    await Publisher(real_redis, "early").register()
    settings = WorkerSettings(redis_url=redis_server.url, run="early",
                              inference=["http://127.0.0.1:9"])  # vLLM not up yet
    with capture_logs() as logs:
        async with role(run_workers(settings)):
            await until(lambda: logged(logs, "inference_unreachable"), "the wait")
            text = render_status(await collect_status(real_redis, "early"))
            assert ("workers: 0 alive, 1 waiting for their inference servers (no job taken "
                    "yet: start vLLM, or check --inference)" in text), text
    text = render_status(await collect_status(real_redis, "early"))
    assert "workers: 0 alive, jobs" in text  # stopped: no longer waiting
    assert "scored 0 (forwarded to the trainer; drops below)" in text


def test_a_missing_dataset_file_names_the_built_in_sample() -> None:
    from rollq.producers.envs.registry import make_env
    from rollq.schemas import ConfigError

    with pytest.raises(ConfigError, match=r"--env gsm8k without --env-option source=\.\.\. "
                                          r"uses its built-in sample"):
        make_env("gsm8k", source="train.jsonl")
