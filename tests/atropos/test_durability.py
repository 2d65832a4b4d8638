"""A real ``rollq atropos-api`` process (uvicorn on a loopback port) and a real redis-server
with AOF: both SIGKILLed mid-run and restarted; no posted group is lost and no acked group
is handed out again. A restarted trainer (a new ``/register``) gets its unacked batch back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.atropos.helpers import REGISTRATION, ApiProcess, atropos_group, marker_of, until
from tests.redis_server import RedisServer

pytest.importorskip("atroposlib", reason="atroposlib is not installed (pip install rollq[atropos])")


@pytest.fixture
def api(make_redis_server: type[RedisServer],
        tmp_path: Path) -> Iterator[tuple[ApiProcess, RedisServer]]:
    redis = make_redis_server(appendonly=True).start()  # type: ignore[call-arg]
    process = ApiProcess(redis.url, "durable", tmp_path / "api.log")
    process.start()
    yield process, redis
    process.stop()


def _batch(api: ApiProcess) -> list[int] | None:
    def once() -> Any:
        response = httpx.get(f"{api.url}/batch", timeout=10)
        return response.json() if response.status_code == 200 else None

    body = until(once)
    return None if body["batch"] is None else [marker_of(g) for g in body["batch"]]


def _post(api: ApiProcess, marker: int) -> None:
    until(lambda: httpx.post(f"{api.url}/scored_data", json=atropos_group(marker, env_id=None),
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
