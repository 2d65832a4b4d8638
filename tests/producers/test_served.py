"""Workers check at start-up that their inference servers serve ``--model`` (issue 32, item
1): a wrong model exits 78 in seconds having taken no job; an unreachable server is waited
for, with a WARNING, and a stop signal ends the wait cleanly."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import httpx
import pytest
import redis.asyncio as aioredis

from rollq.ops.local.stack import free_port
from rollq.producers.inference.served import check_served, mismatch
from rollq.producers.worker import connect_queue, enqueue_rollout, queue_name
from rollq.schemas import ConfigError
from rollq.schemas.keys import stream_key
from tests.producers.fake_vllm import FakeVLLM
from tests.producers.fake_vllm_server import serve_fake
from tests.redis_server import RedisServer

RUN = "served"



async def start_workers(redis_url: str, inference: str, model: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq", "workers", "--run", RUN, "--redis-url", redis_url,
        "--inference", inference, "--model", model, "--log-format", "json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


@pytest.mark.slow  # the workers' process
async def test_a_wrong_model_exits_78_in_seconds_having_taken_no_job(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    queue = await connect_queue(redis_server.url)
    try:
        for position in range(3):  # a feeder admitted these
            await enqueue_rollout(queue, RUN, "gsm8k", position)
    finally:
        await queue.aclose()
    async with serve_fake(FakeVLLM(model="Qwen/Qwen3-0.6B")) as url:
        started = time.monotonic()
        process = await start_workers(redis_server.url, url, "Qwen/Qwen3-8B")
        _, err = await asyncio.wait_for(process.communicate(), 30)
        elapsed = time.monotonic() - started
    assert process.returncode == 78, err.decode()[-2000:]
    # in seconds, having taken no job: ~3 s quietly, 19.7 s once beside a second suite (the
    # process's start included); far from the 600 s a job would time out in
    assert elapsed < 60
    line = err.decode().strip().splitlines()[-1]
    assert "--model 'Qwen/Qwen3-8B' is not served by every --inference server" in line
    assert f"{url} serves Qwen/Qwen3-0.6B" in line
    assert await real_redis.zcard(queue_name(RUN)) == 3  # every job still waits
    for name in ("traj", "dead"):
        assert await real_redis.xlen(stream_key(RUN, 0, name)) == 0


@pytest.mark.slow  # the workers' process
async def test_an_unreachable_server_is_waited_for_and_a_stop_ends_the_wait(
        redis_server: RedisServer) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    process = await start_workers(redis_server.url, url, "m")
    assert process.stderr is not None
    warning = await asyncio.wait_for(process.stderr.readline(), 30)
    while b"inference_unreachable" not in warning:
        warning = await asyncio.wait_for(process.stderr.readline(), 30)
    assert b'"level":"warning"' in warning.replace(b" ", b"") and url.encode() in warning
    process.send_signal(signal.SIGTERM)
    await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0


async def test_the_check_waits_until_a_server_answers() -> None:
    fake = FakeVLLM(model="m")
    answers = {"count": 0}

    async def handle(request: httpx.Request) -> httpx.Response:
        answers["count"] += 1
        if answers["count"] < 3:
            raise httpx.ConnectError("refused", request=request)
        return await fake.handle(request)

    served = await check_served([fake.base_url], "m", poll_s=0.01,
                                transport=httpx.MockTransport(handle))
    assert served == {fake.base_url: ["m"]} and answers["count"] == 3


async def test_a_server_that_is_no_inference_server_is_a_config_error() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(404, text="no such page"))
    with pytest.raises(ConfigError, match="is not an OpenAI-compatible inference server"):
        await check_served(["http://web.test"], "m", transport=transport)


@pytest.mark.parametrize(("served", "model", "problem"), [
    ({"http://a": ["m"], "http://b": ["m", "lora"]}, "m", None),
    ({"http://a": ["m"], "http://b": ["n"]}, "m", "http://b serves n"),
    ({"http://a": ["m"], "http://b": ["m"]}, None, None),
    ({"http://a": ["m"], "http://b": ["n"]}, None, "serve different models"),
])
def test_mismatch(served: dict[str, list[str]], model: str | None, problem: str | None) -> None:
    why = mismatch(served, model)
    assert why is None if problem is None else problem in (why or "")
