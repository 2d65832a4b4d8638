"""Every long-running role stops on SIGTERM/SIGINT in the middle of a Redis outage and
exits 0 within its grace, as after a normal stop (issue 34: the outage rider retried inside
one loop iteration and the stop waited for Redis, until SIGKILL).

Each role runs as a process against its own redis-server, which is killed (kill -9, no
restart); the signal comes 3 s into the outage, and the role's give-up time (300 s) is far
away, so only the stop can end it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from rollq.ops.lifecycle import HTTP_GRACE_S
from rollq.ops.local.stack import free_port
from rollq.schemas.keys import stream_key
from tests.outages.roles import QUICK_REWARD, RoleProcess
from tests.waiting import until

RUN = "stops"
GRACE_S = 5
"""The workers' ``grace_s`` here; every other role stops with no batch in hand."""


async def start_role(role: str, redis_url: str, inference: str, tmp_path: Path) -> RoleProcess:
    """Start ``role`` and return once it is at work."""
    common = ("--redis-url", redis_url, "--run", RUN)
    environ = {"ROLLQ_REDIS_GIVE_UP_S": "300", "ROLLQ_GRACE_S": str(GRACE_S)}
    if role == "workers":
        process = await RoleProcess.start("workers", *common, "--inference", inference,
                                          "--group-size", "2", "--max-tokens", "8", **environ)
        await process.wait_for("worker_started")
    elif role == "score":
        config = tmp_path / "quick.yaml"
        config.write_text(QUICK_REWARD)
        process = await RoleProcess.start("score", *common, "--reward-config", str(config),
                                          "--processes", "1", **environ)
        await process.wait_for("scorer_started")
        await until(lambda: _reading(redis_url), "the scorer's consumer group")
    elif role == "feed":
        process = await RoleProcess.start("feed", *common, "--epochs", "100", **environ)
        await process.wait_for("jobs_admitted")
    else:  # status --watch needs a run to watch: the feeder's in the same process tree
        feeder = await RoleProcess.start("feed", *common, "--epochs", "1", **environ)
        await feeder.wait_for("jobs_admitted")
        feeder.signal(signal.SIGTERM)
        assert await feeder.finish(30) == 0
        process = await RoleProcess.start("status", *common, "--watch", "0.5", **environ)
        await process.first_output()
    return process


async def _reading(redis_url: str) -> bool:
    """Whether the scorer made its consumer group (the last thing it does before its
    loop: a kill earlier would be a failed start-up, exit 69 by design)."""
    redis = aioredis.Redis.from_url(redis_url)
    try:
        return bool(await redis.xinfo_groups(stream_key(RUN, 0, "traj")))
    except aioredis.ResponseError:  # no stream or group yet
        return False
    finally:
        await redis.aclose()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
@pytest.mark.parametrize("role", ["workers", "score", "feed", "status"])
async def test_a_role_signalled_during_an_outage_exits_0_within_its_grace(
        role: str, sig: signal.Signals, make_redis_server: type, inference: str,
        tmp_path: Path) -> None:
    server = make_redis_server().start()
    process = await start_role(role, server.url, inference, tmp_path)
    try:
        await asyncio.to_thread(server.kill)
        await process.wait_for("redis_outage_started")
        await asyncio.sleep(3.0)
        assert process.process.returncode is None, "the role exited before the signal"
        sent = process.signal(sig)
        code = await process.finish(GRACE_S + 15)
        took = time.monotonic() - sent
    finally:
        process.kill()
    assert code == 0, process.lines[-10:]
    # within its grace (plus the exit itself on a loaded machine), not after the outage's
    # 300 s give-up: ~1-2 s quietly
    assert took < GRACE_S + 5, f"{role} took {took:.1f} s to stop"
    assert len(process.events("redis_outage_started")) == 1
    assert not process.events("redis_outage_gave_up")


@pytest.mark.slow
async def test_the_atropos_api_signalled_while_it_holds_a_request_through_an_outage_exits_0(
        make_redis_server: type) -> None:
    """The Atropos API holds a request through a Redis outage (``outage_hold_s``, 30 s
    here); a stop signal then gives it ``HTTP_GRACE_S``, not the whole hold, and exit 0."""
    server = make_redis_server().start()
    port = free_port()
    process = await RoleProcess.start("atropos-api", "--redis-url", server.url, "--run", RUN,
                                      "--port", str(port), ROLLQ_REDIS_GIVE_UP_S="300")
    try:
        await process.wait_for("atropos_api_started")
        await asyncio.to_thread(server.kill)
        async with httpx.AsyncClient(timeout=120) as http:
            held = asyncio.create_task(http.get(f"http://127.0.0.1:{port}/status"))
            await process.wait_for("redis_outage_held")
            await asyncio.sleep(3.0)
            assert process.process.returncode is None and not held.done()
            sent = process.signal(signal.SIGTERM)
            code = await process.finish(HTTP_GRACE_S + 20)
            took = time.monotonic() - sent
            with contextlib.suppress(httpx.HTTPError):
                await held
    finally:
        process.kill()
    assert code == 0, process.lines[-10:]
    assert took < HTTP_GRACE_S + 3, f"atropos-api took {took:.1f} s to stop"
