"""``rollq runs``: list, archive + delete, restore; live runs are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from rollq.ops.cli import Exit, main
from rollq.ops.runs import run_keys
from rollq.producers.publisher import Publisher
from rollq.producers.worker import connect_queue, enqueue_rollout
from rollq.schemas.keys import stream_key
from tests.factories import make_group
from tests.redis_server import RedisServer


async def make_run(redis: aioredis.Redis, url: str, run: str, groups: int = 3) -> None:
    publisher = Publisher(redis, run, partitions=2)
    for i in range(groups):
        await publisher.publish(make_group(run=run, group_id=f"{run}-{i}"))
    queue = await connect_queue(url)
    try:
        await enqueue_rollout(queue, run, "toy", 0)
    finally:
        await queue.aclose()


async def test_list_delete_archive_restore(real_redis: aioredis.Redis,
                                           redis_server: RedisServer, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    await make_run(real_redis, redis_server.url, "old")
    await make_run(real_redis, redis_server.url, "keep")
    url = ["--redis-url", redis_server.url]
    assert await _main(["runs", "list", "--json", *url]) == Exit.OK
    listed = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert listed["old"]["entries"] == 3 and listed["old"]["partitions"] == 2

    keys = await run_keys(real_redis, "old")
    assert any(k.startswith("arq:job:old:") for k in keys)
    assert all("keep" not in k for k in keys)
    # Written a moment ago: refused unless forced.
    assert await _main(["runs", "delete", "old", "--yes", *url]) == Exit.FAILURE
    assert "written" in capsys.readouterr().err
    assert await _main(["runs", "delete", "old", "--dry-run", "--force", *url]) == Exit.OK
    assert await real_redis.exists(*keys) == len(keys)
    archive = tmp_path / "old.rollq"
    assert await _main(["runs", "delete", "old", "--yes", "--force", "--archive",
                        str(archive), *url]) == Exit.OK
    assert await real_redis.exists(*keys) == 0
    assert await real_redis.smembers("rollq:runs") == {b"keep"}
    assert await real_redis.xlen(stream_key("keep", 0, "traj")) + \
        await real_redis.xlen(stream_key("keep", 1, "traj")) == 3

    assert await _main(["runs", "restore", str(archive), *url]) == Exit.OK
    assert await real_redis.exists(*keys) == len(keys)
    assert b"old" in await real_redis.smembers("rollq:runs")
    assert await _main(["runs", "delete", "nope", "--yes", *url]) == Exit.NOT_FOUND


async def test_delete_without_confirmation_on_a_pipe_is_refused(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    await make_run(real_redis, redis_server.url, "old")
    code = await _main(["runs", "delete", "old", "--force", "--redis-url", redis_server.url])
    assert code == Exit.USAGE
    assert await real_redis.exists(stream_key("old", 0, "traj"),
                                   stream_key("old", 1, "traj")) >= 1


async def _main(argv: list[str]) -> int:
    import asyncio

    return await asyncio.to_thread(main, argv, {})
