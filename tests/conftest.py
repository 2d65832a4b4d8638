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
import structlog

from rollq.ops.local.cluster import LocalCluster
from rollq.ops.local.stack import VllmProcess
from tests.budget import Budget
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
_TIER_OF: dict[str, str] = {}
_TIER_OUTCOMES: dict[str, dict[str, int]] = {}


_CLUSTER_FIXTURES = frozenset({"redis_cluster", "fresh_redis_cluster"})
_TLS_FIXTURES = frozenset({"tls_redis"})
TIERS = {
    "fakeredis": "",
    "real redis-server": " (a server this test session started)",
    "redis cluster": " (3 masters + 3 replicas this test session started)",
    "redis tls": " (a TLS-only server with a test CA and ACL users)",
}


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


_VLLM_TESTS: set[str] = set()
_VLLM_OUTCOMES: dict[str, int] = {}
_BUDGET = Budget()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = _tier(item)
        if tier is not None:
            _TIER_OF[item.nodeid] = tier
        if item.get_closest_marker("vllm") is not None:
            _VLLM_TESTS.add(item.nodeid)
        _BUDGET.collected(item, tier)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _BUDGET.reported(report)
    # a test's outcome: its call, or the setup that kept it from running
    if not (report.when == "call" or report.outcome != "passed"):
        return
    tier = _TIER_OF.get(report.nodeid)
    if tier is not None:
        outcomes = _TIER_OUTCOMES.setdefault(tier, {})
        outcomes[report.outcome] = outcomes.get(report.outcome, 0) + 1
    if report.nodeid in _VLLM_TESTS:
        _VLLM_OUTCOMES[report.outcome] = _VLLM_OUTCOMES.get(report.outcome, 0) + 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per Redis tier and one for the vLLM tier, so CI output shows that the
    real-server tests ran."""
    for tier, where in TIERS.items():
        outcomes = _TIER_OUTCOMES.get(tier, {})
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))
        terminalreporter.write_line(f"redis tier {tier}{where}: {counts or 'no tests ran'}")
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(_VLLM_OUTCOMES.items()))
    terminalreporter.write_line("vllm tier (a real CPU vLLM server this test session "
                                f"started): {counts or 'no tests ran'}")
    for line in _BUDGET.lines():
        terminalreporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A test over its time ceiling fails the run (``tests/budget.py``)."""
    if _BUDGET.over_ceiling() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
