"""``rollq workers`` stops on SIGTERM/SIGINT within its grace period and exits 0: idle at
once; busy after the job in hand is finished and published."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis

from bench.fake_vllm import FakeServerProcess
from rollq.producers.publisher import Publisher
from rollq.producers.worker import connect_queue, enqueue_rollout, job_id
from rollq.schemas.keys import stream_key
from tests.redis_server import RedisServer
from tests.waiting import until

RUN = "signals"


@pytest.fixture(scope="module")
def inference() -> Iterator[str]:
    fake = FakeServerProcess().start()
    yield fake.url
    fake.stop()


async def start_workers(redis_url: str, inference: str, env: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq", "workers", "--redis-url", redis_url, "--run", RUN,
        "--inference", inference, "--env", env, "--group-size", "2", "--max-tokens", "8",
        env={**os.environ, "ROLLQ_LOG_FORMAT": "json"},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
async def test_idle_workers_stop_on_a_signal(sig: signal.Signals, redis_server: RedisServer,
                                             real_redis: aioredis.Redis,
                                             inference: str) -> None:
    process = await start_workers(redis_server.url, inference, "gsm8k")
    await _wait_health(real_redis)
    started = time.monotonic()
    process.send_signal(sig)
    code = await asyncio.wait_for(process.wait(), 20)
    assert code == 0
    assert time.monotonic() - started < 20  # promptly: idle, it has no grace to wait out (25 s)


@pytest.mark.slow
async def test_busy_workers_finish_the_job_in_hand_then_exit_0(
        redis_server: RedisServer, real_redis: aioredis.Redis, inference: str) -> None:
    await Publisher(real_redis, RUN).register()
    queue = await connect_queue(redis_server.url)
    await enqueue_rollout(queue, RUN, "gsm8k", 3)
    await queue.aclose()
    process = await start_workers(redis_server.url, inference,
                                  "tests.producers.slow_env:SlowEnv")
    in_progress = f"arq:in-progress:{job_id(RUN, 'gsm8k', 3)}"
    await until(lambda: real_redis.exists(in_progress), "the worker to start the job")
    process.send_signal(signal.SIGTERM)  # mid-job: the 2 s rollout is under way
    code = await asyncio.wait_for(process.wait(), 40)
    assert code == 0
    assert await real_redis.xlen(stream_key(RUN, 0, "traj")) == 1  # finished, not lost


async def _wait_health(redis: aioredis.Redis) -> None:
    for _ in range(400):
        if await redis.keys(f"rollq:{{{RUN}}}:workers:health*"):
            return
        await asyncio.sleep(0.05)
    pytest.fail("the workers never reported health")
