"""Shared fixtures: the two Redis tiers behind one fixture.

``redis`` runs a test twice: against fakeredis (fast, in-process) and against a real
``redis-server`` that this test session starts on a free loopback port. ``real_redis`` is
for the semantics only a real server shows (BLOCK, idle times, Lua, trimming, restarts).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import fakeredis
import pytest
import redis.asyncio as aioredis

from tests.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
async def real_redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushall()
    yield client
    await client.aclose()


@pytest.fixture(params=["fake", "real"])
async def redis(request: pytest.FixtureRequest) -> AsyncIterator[aioredis.Redis]:
    if request.param == "fake":
        client: aioredis.Redis = fakeredis.aioredis.FakeRedis()
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        client = aioredis.Redis.from_url(server.url)
        await client.flushall()
    yield client
    await client.aclose()


@pytest.fixture
def make_redis_server(tmp_path: Path) -> Iterator[type[RedisServer]]:
    """Start extra servers (e.g. with AOF, to restart them); all are stopped after the test."""
    started: list[RedisServer] = []

    class Factory(RedisServer):
        def __init__(self, appendonly: bool = False) -> None:
            super().__init__(tmp_path / f"redis-{len(started)}", appendonly=appendonly)
            started.append(self)

    yield Factory
    for server in started:
        server.stop()
