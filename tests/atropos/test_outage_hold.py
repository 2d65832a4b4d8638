"""Requests ride out a Redis restart (``outage_hold_s``, ``ops.atropos.outage``): held and
answered when Redis is back, a 503 only past the hold. ``rollq atropos-api`` as a process,
a real redis-server with AOF stopped and started under it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.atropos.helpers import REGISTRATION, ApiProcess, atropos_group
from tests.redis_server import RedisServer


def _timed(url: str, out: dict[str, object]) -> None:
    started = time.monotonic()
    try:
        response = httpx.post(f"{url}/scored_data", json=atropos_group(1, env_id=None),
                              timeout=60)
        out["status"] = response.status_code
    finally:
        out["took"] = time.monotonic() - started


@pytest.mark.slow
@pytest.mark.parametrize(("hold", "expected"), [("30", 200), ("1", 503)])
def test_a_redis_restart_is_held_then_answered(make_redis_server: type[RedisServer],
                                               tmp_path: Path, hold: str,
                                               expected: int) -> None:
    redis = make_redis_server(appendonly=True).start()  # type: ignore[call-arg]
    api = ApiProcess(redis.url, "held", tmp_path / "api.log")
    api.env = {"ROLLQ_OUTAGE_HOLD_S": hold}
    api.start()
    try:
        httpx.post(f"{api.url}/register", json=REGISTRATION, timeout=10).raise_for_status()
        redis.kill()
        out: dict[str, object] = {}
        poster = threading.Thread(target=_timed, args=(api.url, out))
        poster.start()
        time.sleep(3)  # Redis away for 3 s, the post waiting
        redis.start()
        poster.join(60)
        assert out["status"] == expected, api.log.read_text()[-3000:]
        if expected == 200:
            assert 2.5 < float(out["took"]) < 30  # held until Redis came back
            queued = httpx.get(f"{api.url}/status", timeout=10).json()["queue_size"]
            assert queued == 1  # stored once
            assert "redis_outage_ridden" in api.log.read_text()
        else:
            # the hold (1 s) ran out before Redis came back (after 3 s): the 503 says so,
            # and it came well before the 30 s a held request would wait
            assert float(out["took"]) < 15
    finally:
        api.stop()
