"""Two ``rollq atropos-api`` processes serve one run at once, behind no load balancer: the
clients alternate between them (and post to both concurrently). Registration, buffers,
the queue, batches and acks are shared through Redis: every group comes out once."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.atropos.helpers import (
    REGISTRATION,
    ApiProcess,
    atropos_group,
    env_registration,
    marker_of,
)
from tests.redis_server import RedisServer

pytest.importorskip("atroposlib", reason="atroposlib is not installed (pip install rollq[atropos])")


@pytest.fixture
def apis(redis_server: RedisServer, tmp_path: Path) -> Iterator[list[ApiProcess]]:
    processes = [ApiProcess(redis_server.url, "pair", tmp_path / f"api{i}.log") for i in (0, 1)]
    try:
        for process in processes:
            process.start()
        yield processes
    finally:
        for process in processes:
            process.stop()


@pytest.mark.slow
def test_two_api_processes_serve_one_run(apis: list[ApiProcess]) -> None:
    with httpx.Client(base_url=apis[0].url, timeout=30) as a, \
            httpx.Client(base_url=apis[1].url, timeout=30) as b:
        _alternate([a, b])


def _alternate(clients: list[httpx.Client]) -> None:

    def call(i: int, method: str, path: str, body: Any = None) -> Any:
        return clients[i % 2].request(method, path, json=body).json()

    assert call(0, "POST", "/register", REGISTRATION)["uuid"]  # 4 sequences: 2 groups
    assert call(1, "GET", "/batch") == {"batch": None}  # the trainer started, on the other
    assert call(0, "GET", "/info")["batch_size"] == call(1, "GET", "/info")["batch_size"] == 4
    assert call(1, "POST", "/register-env", env_registration())["env_id"] == 0
    second = call(0, "POST", "/register-env", env_registration())
    assert (second["env_id"], second["wandb_name"]) == (1, "gsm8k_1")

    with ThreadPoolExecutor(4) as pool:  # envs post to both processes at once
        answers = list(pool.map(lambda m: call(m, "POST", "/scored_data",
                                               atropos_group(m, env_id=m % 2)), range(1, 13)))
    assert answers == [{"status": "received"}] * 12
    # groups of the wrong size are buffered in Redis: halves posted to each process join up
    for marker in (13, 15):
        assert call(0, "POST", "/scored_data", atropos_group(marker, size=1)) == {
            "status": "buffered", "buffer_size": 1}
        assert call(1, "POST", "/scored_data", atropos_group(marker + 1, size=1)) == {
            "status": "buffered", "buffer_size": 0}
    assert call(0, "GET", "/status") == call(1, "GET", "/status") == {
        "current_step": 0, "queue_size": 16}
    statuses = [call(i, "GET", "/status-env", {"env_id": 0}) for i in (0, 1)]
    assert statuses[0] == statuses[1]

    handed: list[list[int]] = []
    for turn in range(7):  # 28 sequences: 7 batches of 4, alternating processes
        batch = call(turn, "GET", "/batch")["batch"]
        assert sum(len(g["tokens"]) for g in batch) == 4
        handed.append([marker_of(g) for g in batch])
    assert call(7, "POST", "/ack-batch")["groups"] == 2  # the last batch, acked on the other
    assert call(8, "GET", "/batch") == {"batch": None}
    assert sorted(m for batch in handed for m in batch) == [*range(1, 17)]  # each once
    assert call(0, "GET", "/status")["queue_size"] == call(1, "GET", "/status")["queue_size"] == 0
