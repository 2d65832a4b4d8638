"""A batch in flight is never lost (issue 32, item 6): ``rollq atropos-api`` as a process
(uvicorn) on a real redis-server, a trainer that polls ``/batch`` as atroposlib's example
trainer does (no re-register, no ``/ack-batch``), and an answer that never reaches it:

- the API is killed (SIGKILL) after the status line went out, before the body did;
- the client drops the connection in the middle of the body.

Either way the next ``/batch`` hands the same batch out again (after ``delivery_wait_s``
when the API died, at once when it saw the client leave): 0 groups lost, duplicates
allowed. The batches are ~13 MB of JSON, and the sabotaged client reads through a 4 KB
socket buffer, so the answer cannot sit whole in the kernel's buffers before the cut.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.atropos.helpers import REGISTRATION, ApiProcess, until
from tests.redis_server import RedisServer

pytest.importorskip("atroposlib", reason="atroposlib is not installed (pip install rollq[atropos])")
requests = pytest.importorskip("requests", reason="the example trainer's HTTP client")

GROUPS = 6
SEQUENCE_TOKENS = 150_000  # x2 sequences x2 groups a batch, ~22 bytes a token in JSON


def _large_group(marker: int) -> dict[str, Any]:
    """Two sequences of random ids (incompressible), all trained but the marker."""
    draw = random.Random(marker)
    tokens = [[marker, *(draw.randrange(2**31) for _ in range(SEQUENCE_TOKENS))]
              for _ in range(2)]
    return {"tokens": tokens, "masks": [[-100, *t[1:]] for t in tokens],
            "scores": [0.0, 1.0], "env_id": None}


@pytest.fixture
def api(redis_server: RedisServer, tmp_path: Path, request: pytest.FixtureRequest,
        ) -> Iterator[ApiProcess]:
    process = ApiProcess(redis_server.url, f"inflight-{request.node.name[-24:]}",
                         tmp_path / "api.log")
    process.start()
    url = process.url
    requests.post(f"{url}/register", json={**REGISTRATION, "batch_size": 4},
                  timeout=10).raise_for_status()
    assert requests.get(f"{url}/batch", timeout=10).json() == {"batch": None}
    for marker in range(1, GROUPS + 1):
        answer = requests.post(f"{url}/scored_data", json=_large_group(marker), timeout=120)
        assert answer.json() == {"status": "received"}
    yield process
    process.stop()


def _start_reading_batch(api: ApiProcess) -> tuple[socket.socket, bytes]:
    """``GET /batch`` through a 4 KB receive buffer; returns the socket once the status
    line and headers are in, and the headers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", api.port))
    sock.sendall(b"GET /batch HTTP/1.1\r\nHost: atropos\r\nAccept-Encoding: identity\r\n\r\n")
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(1024)
        assert chunk, "the API closed the connection before its headers"
        received += chunk
    head = received.split(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    assert length > 10_000_000  # far more than any socket buffer holds
    return sock, head


def _poll_until_every_group(api: ApiProcess) -> list[int]:
    """atroposlib's example trainer loop: GET /batch, retry on errors, until every group
    arrived; returns the markers of every group handed out, in order."""
    seen: list[int] = []

    def poll() -> bool:
        batch = requests.get(f"{api.url}/batch", timeout=60).json()["batch"]
        if batch is not None:
            assert sum(len(group["tokens"]) for group in batch) == 4
            seen.extend(group["tokens"][0][0] for group in batch)
        return set(seen) == set(range(1, GROUPS + 1))

    until(poll, timeout_s=120)
    return seen


def _log(api: ApiProcess) -> str:
    return api.log.read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_api_killed_between_status_line_and_body_loses_no_group(api: ApiProcess) -> None:
    sock, _ = _start_reading_batch(api)
    api.kill()  # SIGKILL: the status line is out, the body is not
    sock.close()
    api.start()  # the trainer keeps polling the restarted API, as before
    seen = _poll_until_every_group(api)
    assert sorted(set(seen)) == list(range(1, GROUPS + 1))  # 0 lost
    assert len(seen) == GROUPS  # the cut batch came back once, and was the only repeat
    assert '"reason": "answer_unconfirmed"' in _log(api)
    httpx.post(f"{api.url}/ack-batch", timeout=10)
    assert httpx.get(f"{api.url}/status", timeout=10).json()["queue_size"] == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_client_dropping_the_connection_mid_body_loses_no_group(api: ApiProcess) -> None:
    sock, _ = _start_reading_batch(api)
    assert len(sock.recv(65536)) > 0  # part of the body
    sock.close()  # the trainer goes away mid-body (a timeout, a crash)
    until(lambda: "batch_not_delivered" in _log(api), timeout_s=60)
    seen = _poll_until_every_group(api)
    assert sorted(set(seen)) == list(range(1, GROUPS + 1))  # 0 lost
    assert len(seen) == GROUPS
    assert '"reason": "answer_not_sent"' in _log(api)
