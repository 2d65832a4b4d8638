"""No silent stall (issue 32, item 3): each way a run stops making progress gets ONE
WARNING from the roles that see it, within the configured time; the trainer SDK logs while
it waits. Real redis-server, the real roles (``ops.roles``) and the real trainer client."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from rollq.consumers.trainer import TrainerClient, TrainerClientSettings
from rollq.ops.roles import run_feeder, run_scorer, run_workers
from rollq.ops.settings import FeederSettings, ScorerSettings, WorkerSettings
from rollq.ops.watchdog import RunWatchdog
from rollq.producers.publisher import Publisher
from rollq.producers.worker import queue_name
from rollq.schemas import breaker
from rollq.schemas.keys import (
    CONSUMED_COUNTER,
    TRAINER_WAITING_FIELD,
    counters_key,
    state_key,
)
from rollq.schemas.tasks import beside
from tests.factories import make_group
from tests.producers.fake_vllm import FakeVLLM, fake_transport
from tests.redis_server import RedisServer
from tests.waiting import until

SAME_LENGTH_REWARD = ("components:\n  - name: length\n    component: length_bounty\n"
                      "advantages: {zero_variance: drop}\n")
STALL_S = 1.0


def role(start: Coroutine[Any, Any, Any]) -> AbstractAsyncContextManager[asyncio.Task[Any]]:
    """A role run in this process beside the test's block, cancelled when it ends."""
    return beside(start)


def logged(logs: list[dict[str, Any]], event: str,
           level: str = "warning") -> list[dict[str, Any]]:
    """The entries of ``event`` logged at ``level``."""
    return [e for e in logs if e["event"] == event and e["log_level"] == level]


async def test_all_groups_dropped_as_zero_variance_is_one_warning_with_the_share(
        real_redis: aioredis.Redis, redis_server: RedisServer, tmp_path: Path) -> None:
    config = tmp_path / "reward.yaml"
    config.write_text(SAME_LENGTH_REWARD)
    publisher = Publisher(real_redis, "flat")
    await publisher.register()
    # longer than the gaps between the 5 groups' scoring on a loaded machine, so the one
    # warning comes after all 5 (a gap as long would be a stall of its own)
    stall_s = 4 * STALL_S
    settings = ScorerSettings(redis_url=redis_server.url, run="flat", reward_config=config,
                              processes=1, stall_warning_s=stall_s, block_ms=100)
    with capture_logs() as logs:
        async with role(run_scorer(settings, asyncio.Event())):
            # the groups arrive once the scorer's watchdog has its first look at the run
            await until(lambda: any(e["event"] == "scorer_started" for e in logs),
                        "the scorer's start", timeout_s=60)
            await asyncio.sleep(0.5)
            for seed in range(5):
                await publisher.publish(make_group(run="flat", seed=seed))
            await until(lambda: logged(logs, "groups_all_zero_variance"),
                        "the zero-variance warning", timeout_s=60)
            await asyncio.sleep(3 * stall_s)  # once: no second line while nothing changes
    [warning] = logged(logs, "groups_all_zero_variance")
    assert warning["dropped"] == 5 and warning["run_share"] == 1.0, warning
    assert "all 5 groups scored in the last" in warning["message"]
    assert "zero-variance (100% of the run's groups)" in warning["message"]
    assert not logged(logs, "run_stalled")


async def test_a_scorer_on_a_run_that_did_not_exist_names_the_known_runs(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    await Publisher(real_redis, "gsm8k-grpo").register()
    settings = ScorerSettings(redis_url=redis_server.url, run="gsm8k-gpro", processes=1,
                              stall_warning_s=STALL_S, block_ms=100)
    with capture_logs() as logs:
        async with role(run_scorer(settings, asyncio.Event())):
            await until(lambda: logged(logs, "run_not_found_at_start"),
                        "the unknown-run warning", timeout_s=60)
    [warning] = logged(logs, "run_not_found_at_start")
    assert warning["known_runs"] == ["gsm8k-grpo"]
    assert ("run 'gsm8k-gpro' did not exist when this scorer started" in warning["message"]
            and "known runs: gsm8k-grpo: a typo in --run?" in warning["message"])


async def test_workers_on_a_run_that_did_not_exist_name_the_known_runs(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    await Publisher(real_redis, "gsm8k-grpo").register()
    fake = FakeVLLM()
    settings = WorkerSettings(redis_url=redis_server.url, run="gsm8k-gpro",
                              inference=[fake.base_url], model=fake.model,
                              stall_warning_s=STALL_S)
    with capture_logs() as logs:
        async with role(run_workers(settings, transport=fake_transport(fake))):
            await until(lambda: logged(logs, "run_not_found_at_start"),
                        "the unknown-run warning", timeout_s=60)
    [warning] = logged(logs, "run_not_found_at_start")
    assert warning["role"] == "workers" and warning["known_runs"] == ["gsm8k-grpo"]


async def test_feed_batch_groups_below_the_trainers_is_named_as_a_deadlock(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    """feed --batch-groups 4 --max-staleness 2, trainer steps of 8, and no policy version
    published: 12 admitted, 8 consumed, budget 0, the trainer waits for 8 of 4."""
    settings = FeederSettings(redis_url=redis_server.url, run="mismatch", batch_groups=4,
                              max_staleness=2, stall_warning_s=STALL_S, poll_s=0.05)
    trainer_settings = TrainerClientSettings(block_ms=50, reclaim_every_s=3600.0,
                                             wait_log_s=0.2, batch_groups=8)
    with capture_logs() as logs:
        async with role(run_feeder(settings, asyncio.Event())):
            await until(lambda: real_redis.zcard(queue_name("mismatch")), "admission")
            await until(lambda: _equals(real_redis.zcard(queue_name("mismatch")), 12),
                        "the first budget")
            # the trainer trained one step of 8 (the jobs' groups) and waits for the next
            await real_redis.hincrby(counters_key("mismatch", 0), CONSUMED_COUNTER, 8)
            async with TrainerClient(real_redis, run="mismatch", consumer="t",
                                     settings=trainer_settings) as trainer:
                async with role(trainer.next_batch()):
                    await until(lambda: logged(logs, "admission_budget_exhausted"),
                                "the budget warning", timeout_s=60)
            assert await real_redis.hget(state_key("mismatch"), TRAINER_WAITING_FIELD) is None
    [warning] = logged(logs, "admission_budget_exhausted")
    assert (warning["budget"], warning["consumed"], warning["outstanding"]) == (12, 8, 4)
    assert warning["trainer_waiting_groups"] == 8
    assert ("the trainer waits for 8 groups per step but at most 4 are outstanding: a "
            "deadlock. feed --batch-groups 4 must be at least the trainer's 8"
            in warning["message"])
    waits = [e for e in logs if e["event"] == "trainer_waiting"]
    assert waits and waits[-1]["groups_wanted"] == 8 and waits[-1]["groups_held"] == 0


async def test_an_open_breaker_is_one_error_line_in_a_waiting_trainer(
        real_redis: aioredis.Redis) -> None:
    for _ in range(2):
        await breaker.record_failure(real_redis, "stopped", "contract_error", "404")
    assert await breaker.trip(real_redis, "stopped", 2) is not None
    settings = TrainerClientSettings(block_ms=50, reclaim_every_s=3600.0, wait_log_s=0.1)
    with capture_logs() as logs:
        async with TrainerClient(real_redis, run="stopped", consumer="t",
                                 settings=settings) as trainer:
            await trainer.next_batch(groups=1, timeout_s=1.0)
    errors = [e for e in logs if e["event"] == "admission_stopped"]
    assert len(errors) == 1 and errors[0]["log_level"] == "error"
    assert "rollq runs resume stopped" in errors[0]["message"]


async def _equals(value: Any, expected: int) -> bool:
    return bool(await value == expected)


@pytest.mark.parametrize("wait_log_s", [0.0, -1.0])
def test_wait_log_s_must_be_positive(wait_log_s: float) -> None:
    with pytest.raises(ValueError, match="wait_log_s"):
        TrainerClientSettings(wait_log_s=wait_log_s)


async def test_a_finished_run_is_idle_not_stalled(real_redis: aioredis.Redis) -> None:
    await Publisher(real_redis, "done").register()
    await real_redis.hset(state_key("done"), "admitted", 3)
    await real_redis.hincrby(counters_key("done", 0), CONSUMED_COUNTER, 2)
    await real_redis.hincrby(counters_key("done", 0), "drop:zero_variance", 1)
    watchdog = RunWatchdog(real_redis, "done", "workers", stall_s=0.1)
    with capture_logs() as logs:
        await watchdog.check()  # the first reading: progress so far
        await asyncio.sleep(0.2)
        await watchdog.check()
        await watchdog.check()
    assert watchdog.warned == "run_idle"
    assert [(e["event"], e["log_level"]) for e in logs] == [("run_idle", "info")]
