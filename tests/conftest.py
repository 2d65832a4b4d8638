"""Shared fixtures: the two Redis tiers behind one fixture.

``redis`` runs a test twice: against fakeredis (fast, in-process) and against a real
``redis-server`` that this test session starts on a free loopback port. ``real_redis`` is
for the semantics only a real server shows (BLOCK, idle times, Lua, trimming, restarts).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import fakeredis
import pytest
import redis.asyncio as aioredis
import structlog

from rollq.ops.local.cluster import LocalCluster
from rollq.ops.local.stack import VllmProcess
from tests.budget import SuiteRecord, classify, is_xdist_worker
from tests.integration.interpreters import vllm_python
from tests.redis_server import RedisServer
from tests.redis_tls import TlsRedis


@pytest.fixture(autouse=True)
def _structlog_restored() -> Iterator[None]:
    """A test that runs a command in-process configures logging (its level too); the next
    test's ``capture_logs`` must not inherit that level, so every test starts from the
    configuration it found."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


TOOL_TEMPLATE = Path(__file__).parent / "agents" / "tool_template.jinja"
"""The session server's chat template: tools and tool calls rendered (the agents' tests), and
plain messages exactly as the tiny model's own template renders them."""


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollq.ops.local.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model") / "rollq-tiny", seed=0)


@pytest.fixture(scope="session")
def vllm_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmProcess]:
    """The session's CPU vLLM server with the tiny model, for every vLLM-tier test that can
    share it (one start, ~40-90 s): rollq_tcp weight transfer (the transfer tests sync into
    it; reload works beside it) and tool calling (the agents' tests)."""
    python = vllm_python()
    cache = Path(python).resolve().parent.parent / "inductor-cache"
    server = VllmProcess(python, tiny_model, tmp_path_factory.mktemp("vllm") / "server.log",
                         max_model_len=1024, compile_cache=cache, weight_transfer="rollq_tcp",
                         extra_args=["--enable-auto-tool-choice", "--tool-call-parser",
                                     "hermes", "--chat-template", str(TOOL_TEMPLATE)]).start()
    yield server
    server.stop()


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


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A real local Redis Cluster (3 masters + 3 replicas), shared by the session's tests;
    a test that kills a node uses ``fresh_redis_cluster``."""
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def fresh_redis_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A cluster of the test's own, to kill nodes in."""
    cluster = LocalCluster(tmp_path / "cluster").start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    """A real redis-server speaking only TLS, with a CA made for the session and ACL users
    (``tls_redis.acl(user, password, *rules)``)."""
    server = TlsRedis(tmp_path_factory.mktemp("tls")).start()
    yield server
    server.stop()


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
_CLUSTER_FIXTURES = frozenset({"redis_cluster", "fresh_redis_cluster"})
_TLS_FIXTURES = frozenset({"tls_redis"})


def _tier(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    param = callspec.params.get("redis") if callspec is not None else None
    fixtures = set(getattr(item, "fixturenames", ()))
    if _CLUSTER_FIXTURES & fixtures:
        return "redis cluster"
    if _TLS_FIXTURES & fixtures:
        return "redis tls"
    if param == "fake":
        return "fakeredis"
    if param == "real" or _REAL_FIXTURES & fixtures:
        return "real redis-server"
    return None


_SUITE = SuiteRecord()
"""Every test's tiers, outcomes and time (``tests/budget.py``)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        classify(item, _tier(item))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SUITE.reported(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Runs before the terminal summary: add earlier runs' records (``.ci/test``'s two
    runs), and fail the run when a test is over its time ceiling."""
    if is_xdist_worker(session.config):
        return  # the controller counts every worker's reports
    if record := os.environ.get("ROLLQ_SUITE_RECORD"):
        _SUITE.merge(Path(record))
    if _SUITE.over_ceiling() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if is_xdist_worker(terminalreporter.config):
        return
    for line in [*_SUITE.tier_lines(), *_SUITE.time_lines(), *_SUITE.figure_lines()]:
        terminalreporter.write_line(line)
