"""A real ``rollq atropos-api`` process (uvicorn on a loopback port) and a real redis-server
with AOF: both SIGKILLed mid-run and restarted; no posted group is lost and no acked group
is handed out again. A restarted trainer (a new ``/register``) gets its unacked batch back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.atropos.helpers import REGISTRATION, atropos_group, marker_of
from tests.redis_server import RedisServer, free_port

pytest.importorskip("atroposlib", reason="atroposlib is not installed (pip install rollq[atropos])")

ROOT = Path(__file__).resolve().parents[2]


class ApiProcess:
    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "atropos-api", "--redis-url", self.redis_url,
             "--run", "durable", "--port", str(self.port), "--log-format", "json"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        _until(lambda: httpx.get(f"{self.url}/info", timeout=1).status_code == 200)

    def kill(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=10)


def _until(check: Any, timeout_s: float = 30.0) -> Any:
    """Poll ``check`` until it returns something truthy (exceptions count as not yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
            if result:
                return result
        except (httpx.HTTPError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


@pytest.fixture
def api(make_redis_server: type[RedisServer]) -> Iterator[tuple[ApiProcess, RedisServer]]:
    redis = make_redis_server(appendonly=True).start()  # type: ignore[call-arg]
    process = ApiProcess(redis.url)
    process.start()
    yield process, redis
    process.stop()


def _batch(api: ApiProcess) -> list[int] | None:
    def once() -> Any:
        response = httpx.get(f"{api.url}/batch", timeout=10)
        return response.json() if response.status_code == 200 else None

    body = _until(once)
    return None if body["batch"] is None else [marker_of(g) for g in body["batch"]]


def _post(api: ApiProcess, marker: int) -> None:
    _until(lambda: httpx.post(f"{api.url}/scored_data", json=atropos_group(marker, env_id=None),
                              timeout=10).json() == {"status": "received"})


@pytest.mark.slow
def test_api_and_redis_crashes_lose_nothing_and_repeat_no_acked_group(
        api: tuple[ApiProcess, RedisServer]) -> None:
    process, redis = api
    httpx.post(f"{process.url}/register", json=REGISTRATION, timeout=10)  # 2 groups a batch
    for marker in range(1, 9):
        _post(process, marker)
    first = _batch(process)
    assert first is not None and len(first) == 2

    process.kill()  # the API dies while the trainer trains on `first`
    process.start()
    httpx.post(f"{process.url}/register", json=REGISTRATION, timeout=10)  # trainer restarts
    assert _batch(process) == first  # not acked yet: handed out again

    handed = [first, _batch(process)]  # that call acked `first`
    redis.kill()  # Redis dies (AOF, fsync always) and comes back with the same data
    redis.start()
    for marker in (9, 10):
        _post(process, marker)
    while (batch := _batch(process)) is not None:
        handed.append(batch)
    assert httpx.post(f"{process.url}/ack-batch", timeout=10).json()["status"] == "acked"
    seen = [m for batch in handed for m in batch if batch is not None]
    assert sorted(seen) == list(range(1, 11))  # every group once: none lost, none repeated
    assert _batch(process) is None
    status = httpx.get(f"{process.url}/status", timeout=10).json()
    assert status["queue_size"] == 0
