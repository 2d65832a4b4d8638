"""``rollq status`` and ``rollq tail`` against a live redis-server, and without one."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import pytest
import redis.asyncio as aioredis

from rollq.consumers.bus import ReaderSettings, StreamReader
from rollq.consumers.stage import Stage
from rollq.ops.cli import Exit, main
from rollq.producers.publisher import Publisher
from rollq.schemas.keys import stream_key
from tests.factories import make_group
from tests.redis_server import RedisServer, free_port
from tests.test_bus import scored_forward
from tests.waiting import until


async def _populate(redis: aioredis.Redis) -> None:
    publisher = Publisher(redis, "demo")
    for i in range(3):
        await publisher.publish(make_group(run="demo", group_id=f"g{i}", texts=[
            f"answer {i} {j}" for j in range(4)]))
    await redis.xadd(stream_key("demo", 0, "traj"), {b"v": b"9"})  # a bad entry
    reader = StreamReader(redis, [stream_key("demo", 0, "traj")], "scorers", "s1",
                          ReaderSettings(block_ms=10))
    await Stage(reader, scored_forward).drain()


async def following(redis: aioredis.Redis) -> bool:
    """``rollq tail`` is following: blocked in an XREAD on the server (its loop runs, so
    its signal handlers are installed)."""
    return any(c.get("cmd") == "xread" for c in await redis.client_list())


def run_cli(*argv: str, url: str) -> tuple[int, str, str]:
    process = subprocess.run(
        [sys.executable, "-m", "rollq", *argv, "--redis-url", url],
        capture_output=True, text=True, timeout=60,
    )
    return process.returncode, process.stdout, process.stderr


async def test_status_shows_streams_groups_and_drops(
    real_redis: aioredis.Redis, redis_server: RedisServer
) -> None:
    await _populate(real_redis)
    code, out, err = await asyncio.to_thread(run_cli, "status", "--run", "demo",
                                             url=redis_server.url)
    assert code == Exit.OK, err
    assert "scored 3" in out
    assert "rollq:{demo:0}:traj" in out and "scorers" in out
    assert "drops by reason: unknown_version_error 1" in out
    code, out, _ = await asyncio.to_thread(run_cli, "status", "--run", "demo", "--json",
                                           url=redis_server.url)
    document = json.loads(out)
    assert document["drops"] == {"unknown_version_error": 1}
    assert document["counters"]["scored"] == 3
    lengths = {s["key"]: s["length"] for s in document["streams"]}
    assert lengths["rollq:{demo:0}:scored"] == 3 and lengths["rollq:{demo:0}:dead"] == 1


async def test_tail_prints_existing_and_new_entries(
    real_redis: aioredis.Redis, redis_server: RedisServer
) -> None:
    await _populate(real_redis)
    code, out, err = await asyncio.to_thread(
        run_cli, "tail", "scored", "--run", "demo", "--from-start", "--count", "3",
        url=redis_server.url)
    assert code == Exit.OK, err
    assert out.count("scored group=g") == 3
    assert "answer 1 2" in out and "reward=" in out
    code, out, _ = await asyncio.to_thread(
        run_cli, "tail", "dead", "--run", "demo", "--from-start", "--count", "1",
        url=redis_server.url)
    assert "dead reason=unknown_version_error" in out
    assert await real_redis.xinfo_groups(stream_key("demo", 0, "dead")) == []


async def test_tail_follows_new_entries(real_redis: aioredis.Redis,
                                        redis_server: RedisServer) -> None:
    await _populate(real_redis)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq", "tail", "traj", "--run", "demo", "--count", "1",
        "--redis-url", redis_server.url, stdout=asyncio.subprocess.PIPE)

    await until(lambda: following(real_redis), "rollq tail to start following")
    await Publisher(real_redis, "demo").publish(make_group(run="demo", group_id="fresh"))
    out, _ = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0
    assert "group=fresh" in out.decode() and "group=g0" not in out.decode()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
async def test_tail_stops_on_a_signal_and_exits_0(sig: signal.Signals,
                                                  real_redis: aioredis.Redis,
                                                  redis_server: RedisServer) -> None:
    await _populate(real_redis)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq", "tail", "traj", "--run", "demo",
        "--redis-url", redis_server.url, stdout=asyncio.subprocess.PIPE)

    await until(lambda: following(real_redis), "rollq tail to start following")
    process.send_signal(sig)
    await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0


@pytest.mark.parametrize("command", [["status"], ["tail", "traj"]])
def test_unreachable_redis_fails_clearly(command: list[str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert main([*command, "--redis-url", url], environ={}) == Exit.UNAVAILABLE
    assert "cannot reach Redis" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["status"], ["tail", "traj"]])
async def test_missing_run_fails_clearly(command: list[str], redis_server: RedisServer,
                                         real_redis: aioredis.Redis) -> None:
    await _populate(real_redis)
    code, _, err = await asyncio.to_thread(run_cli, *command, "--run", "ghost",
                                           url=redis_server.url)
    assert code == Exit.NOT_FOUND
    assert "run 'ghost' not found (known runs: demo)" in err


def test_bad_setting_names_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status"], environ={"ROLLQ_PARTITIONS": "zero"}) == Exit.CONFIG
    assert "partitions (from ROLLQ_PARTITIONS)" in capsys.readouterr().err
