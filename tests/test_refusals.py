"""Refusals are configuration errors, never outages (issue 34): a role whose ACL user lacks
a key or a command, or whose password is wrong, exits 78 at once with one line naming the
user, the command and the key pattern it lacks."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from rollq.ops.cli.common import Exit
from rollq.ops.connections import open_redis
from rollq.ops.settings import CommonSettings
from rollq.schemas.errors import AccessRefused, access_refused, translated_errors
from tests.outages.roles import RoleProcess

RUN = "acl"
PASSWORD = "feeder-pw-51"


async def add_user(url: str, user: str, *rules: str) -> str:
    """Add an ACL user to the server at ``url``; returns the URL that logs in as it."""
    admin = aioredis.Redis.from_url(url)
    await admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", *rules)
    await admin.aclose()
    return url.replace("redis://", f"redis://{user}:{PASSWORD}@")


@pytest.mark.slow
async def test_a_feeder_without_arqs_keys_exits_78_at_once(make_redis_server: type) -> None:
    server = make_redis_server().start()
    url = await add_user(server.url, "feeder", "~rollq:*", "+@all")  # no ~arq:*
    started = time.monotonic()
    process = await RoleProcess.start("feed", "--redis-url", url, "--run", RUN,
                                      ROLLQ_REDIS_GIVE_UP_S="300")
    try:
        code = await process.finish(30)
    finally:
        process.kill()
    assert code == Exit.CONFIG, process.lines[-5:]
    # At once: the refusal is not ridden out as an outage (redis_give_up_s is 300 s here).
    # ~1-2 s quietly, 5.6 s once beside a second suite: the bound is far from both.
    assert time.monotonic() - started < 60
    assert not process.events("redis_outage_started")
    failed = process.events("command_failed")
    assert len(failed) == 1
    message = failed[0]["message"]
    assert "'feeder'" in message and "~arq:job:acl:" in message, message
    assert PASSWORD not in message


async def test_a_refused_command_names_the_user_and_the_command(
        make_redis_server: type) -> None:
    server = make_redis_server().start()
    url = await add_user(server.url, "scorer", "~rollq:*", "+@all", "-xadd")
    redis = open_redis(CommonSettings(redis_url=url, run=RUN))
    try:
        with pytest.raises(AccessRefused, match=r"'scorer' the command XADD \(ACL rule \+xadd"):
            await redis.xadd("rollq:{acl:0}:traj", {"v": "1"})
        with pytest.raises(AccessRefused, match=r"'scorer' the key pattern ~other:key for GET"):
            await redis.get("other:key")
    finally:
        await redis.aclose()


async def test_a_wrong_password_is_a_refusal_not_an_outage(make_redis_server: type) -> None:
    server = make_redis_server().start()
    url = await add_user(server.url, "trainer", "~rollq:*", "+@all")
    redis = open_redis(CommonSettings(redis_url=url.replace(PASSWORD, "wrong"), run=RUN))
    try:
        with pytest.raises(AccessRefused, match="credentials of 'trainer'"):
            async with translated_errors("reading"):
                await redis.get("rollq:{acl}:state")
    finally:
        await redis.aclose()


def test_a_refusal_inside_a_script_names_the_key() -> None:
    refused = access_refused(
        redis_errors.NoPermissionError("this user has no permissions to access one of the "
                                       "keys used as arguments"),
        user="feeder", command=(b"EVALSHA", b"0123abcd", 1, b"rollq:{x}:state", 7))
    assert "'feeder' the key pattern ~rollq:{x}:state for EVALSHA" in str(refused)


@pytest.mark.slow
async def test_workers_whose_publish_is_refused_stop_with_78_and_keep_the_job(
        make_redis_server: type) -> None:
    """A job whose XADD is refused is neither retried into a dead letter nor lost: it goes
    back to the queue and the pool stops with the configuration error."""
    from rollq.ops.roles import run_workers
    from rollq.ops.settings import WorkerSettings
    from rollq.producers.publisher import Publisher
    from rollq.producers.worker import connect_queue, enqueue_rollout, queue_name
    from rollq.schemas.keys import stream_key
    from tests.producers.fake_vllm import FakeVLLM, fake_transport

    server = make_redis_server().start()
    admin = aioredis.Redis.from_url(server.url)
    await Publisher(admin, RUN).register()
    queue = await connect_queue(server.url)
    await enqueue_rollout(queue, RUN, "gsm8k", 0)
    await queue.aclose()
    url = await add_user(server.url, "workers", "~*", "+@all", "-xadd")
    fake = FakeVLLM()
    settings = WorkerSettings(redis_url=url, run=RUN, inference=[fake.base_url], group_size=2,
                              max_tokens=8)
    with pytest.raises(AccessRefused, match="'workers' the command XADD"):
        await asyncio.wait_for(run_workers(settings, burst=True,
                                           transport=fake_transport(fake)), 60)
    assert await admin.zcard(queue_name(RUN)) == 1  # back in the queue, not failed
    assert await admin.xlen(stream_key(RUN, 0, "dead")) == 0
    await admin.aclose()
