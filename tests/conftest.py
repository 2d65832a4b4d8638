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


# --------------------------------------------------- which Redis tier each test ran on

_REAL_FIXTURES = frozenset({"redis_server", "real_redis", "make_redis_server"})
_TIER_OF: dict[str, str] = {}
_TIER_OUTCOMES: dict[str, dict[str, int]] = {}


def _tier(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    param = callspec.params.get("redis") if callspec is not None else None
    if param == "fake":
        return "fakeredis"
    if param == "real" or _REAL_FIXTURES & set(getattr(item, "fixturenames", ())):
        return "real redis-server"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = _tier(item)
        if tier is not None:
            _TIER_OF[item.nodeid] = tier


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = _TIER_OF.get(report.nodeid)
    # a test's outcome: its call, or the setup that kept it from running
    if tier is None or not (report.when == "call" or report.outcome != "passed"):
        return
    outcomes = _TIER_OUTCOMES.setdefault(tier, {})
    outcomes[report.outcome] = outcomes.get(report.outcome, 0) + 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per Redis tier, so CI output shows that the real-server tests ran."""
    for tier in ("fakeredis", "real redis-server"):
        outcomes = _TIER_OUTCOMES.get(tier, {})
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))
        where = " (a server this test session started)" if tier != "fakeredis" else ""
        terminalreporter.write_line(f"redis tier {tier}{where}: {counts or 'no tests ran'}")
