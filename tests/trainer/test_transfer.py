"""The transfer control plane without a server: chunking, the fan-out client's failures,
the recovery of a server that vLLM still holds mid-update. The real protocol runs against
real CPU vLLM servers in tests/integration/test_weight_sync_vllm.py."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest

from rollq.consumers.trainer.transfer import (
    DISCARD,
    ServerFanout,
    ServersFailed,
    TcpTrainerEngine,
    TcpTrainerInitInfo,
    chunks,
)

torch = pytest.importorskip("torch", reason="needs the train extra")


def fanout(handle, *urls: str) -> ServerFanout:  # type: ignore[no-untyped-def]
    return ServerFanout(list(urls), httpx.Client(transport=httpx.MockTransport(handle)))


def test_chunks_stay_under_the_bound_and_a_larger_tensor_goes_alone() -> None:
    pairs = [(f"p{i}", torch.zeros(n, dtype=torch.float32)) for i, n in
             enumerate([100, 100, 100, 1000, 10, 10])]  # 400, 400, 400, 4000, 40, 40 bytes
    found = [[name for name, _ in chunk] for chunk in chunks(pairs, chunk_bytes=900)]
    assert found == [["p0", "p1"], ["p2"], ["p3"], ["p4", "p5"]]
    assert all(t.is_contiguous() for chunk in chunks(pairs, 900) for _, t in chunk)


def test_a_sharded_tensor_is_refused_rather_than_sent_as_its_shard() -> None:
    class Shard:  # what FSDP's DTensor looks like to the sender
        def full_tensor(self) -> None:
            raise AssertionError("a collective on one rank would hang")

    with pytest.raises(TypeError, match="gather the full state dict"):
        list(chunks([("w", Shard())], chunk_bytes=1024))


def test_each_failed_server_is_named_with_a_hint_for_a_missing_transfer_config() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "b":
            return httpx.Response(500, json={"error": {"message": "Weight transfer not "
                                  "configured. Please set weight_transfer_config"}})
        return httpx.Response(200, json={})

    client = fanout(handle, "http://a:1", "http://b:1")
    with pytest.raises(ServersFailed) as raised:
        client.init_weight_transfer_engine({"timeout_s": 5})
    assert list(raised.value.failures) == ["http://b:1"]
    assert "--weight-transfer-config" in raised.value.failures["http://b:1"]


def test_a_refused_init_leaves_no_listening_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    """rollq_tcp's trainer listens before it asks the servers to start: a refusal closes
    the listener (left open, it would be the garbage collector's, a ResourceWarning in
    whichever later test collected it)."""
    listeners: list[socket.socket] = []
    create_server = socket.create_server

    def recorded(*args: Any, **kwargs: Any) -> socket.socket:
        listeners.append(create_server(*args, **kwargs))
        return listeners[-1]

    monkeypatch.setattr(socket, "create_server", recorded)
    refusing = fanout(lambda request: httpx.Response(500, json={"error": {"message": "no"}}),
                      "http://a:1")
    with pytest.raises(ServersFailed):
        TcpTrainerEngine.trainer_init(TcpTrainerInitInfo(), client=refusing)
    [listener] = listeners
    assert listener.fileno() == -1  # closed


def test_nccl_init_gives_each_server_its_own_rank_offset() -> None:
    bodies: dict[str, object] = {}

    def handle(request: httpx.Request) -> httpx.Response:
        bodies[request.url.host] = json.loads(request.content)
        return httpx.Response(200, json={})

    client = fanout(handle, "http://a:1", "http://b:1", "http://c:1")
    client.workers_per_server = 2
    client.init_weight_transfer_engine({"master_port": 7, "rank_offset": 1, "world_size": 7})
    offsets = {host: body["init_info"]["rank_offset"] for host, body in bodies.items()}  # type: ignore[index]
    assert offsets == {"a": 1, "b": 3, "c": 5}


def test_a_server_stuck_mid_update_drops_its_leftovers_then_starts() -> None:
    calls: list[tuple[str, object]] = []
    stuck = {"b"}

    def handle(request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        calls.append((host + path, json.loads(request.content) if request.content else None))
        if path == "/start_weight_update" and host in stuck:
            return httpx.Response(500, json={"error": {"message": "already active"}})
        if path == "/finish_weight_update":
            stuck.discard(host)
        return httpx.Response(200, json={})

    client = fanout(handle, "http://a:1", "http://b:1")
    client.discard_update = DISCARD
    client.start_weight_update()
    assert [c for c, _ in calls if c.startswith("b")] == [
        "b/start_weight_update", "b/update_weights", "b/finish_weight_update",
        "b/start_weight_update"]
    assert ("b/update_weights", {"update_info": DISCARD}) in calls
    assert [c for c, _ in calls if c.startswith("a")] == ["a/start_weight_update"]
