"""Shared helpers of the trainer SDK tests: publish scored groups, read counters, and a
recording fake of vLLM's weight-sync routes."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

import httpx
import redis.asyncio as aioredis

from rollq.consumers.trainer import TrainerClient, TrainerClientSettings
from rollq.schemas import ScoredGroup, TrajectoryGroup, encode
from rollq.schemas.keys import PARTITIONS_FIELD, counters_key, partition_of, state_key, stream_key
from tests.factories import make_group, score

RUN = "test"
FAST = TrainerClientSettings(block_ms=50, reclaim_every_s=3600.0)


def client(redis: aioredis.Redis, consumer: str = "rank0", **settings: object) -> TrainerClient:
    base = {f: getattr(FAST, f) for f in FAST.__dataclass_fields__}
    return TrainerClient(redis, run=RUN, consumer=consumer,
                         settings=TrainerClientSettings(**{**base, **settings}))


async def publish_scored(redis: aioredis.Redis, group: TrajectoryGroup | ScoredGroup,
                         partitions: int = 1) -> str:
    """Publish a group's trajectory to its partition's traj stream and its scores to the
    scored stream in reference form, as the publisher and the scorer's forward do."""
    scored = group if isinstance(group, ScoredGroup) else score(group)
    await redis.hsetnx(state_key(RUN), PARTITIONS_FIELD, str(partitions))
    partition = partition_of(scored.group_id, partitions)
    traj_id = _text(await redis.xadd(stream_key(RUN, partition, "traj"),
                                     encode(scored.trajectory)))  # type: ignore[arg-type]
    return _text(await redis.xadd(stream_key(RUN, partition, "scored"),
                                  encode(scored, trajectory_id=traj_id)))  # type: ignore[arg-type]


def _text(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


async def publish_many(redis: aioredis.Redis, n: int, partitions: int = 1,
                       prefix: str = "g", **group: object) -> list[str]:
    ids = [f"{prefix}{i:03d}" for i in range(n)]
    for i, group_id in enumerate(ids):
        await publish_scored(redis, make_group(group_id=group_id, seed=i, **group),  # type: ignore[arg-type]
                             partitions)
    return ids


async def counter(redis: aioredis.Redis, name: str, partitions: int = 1) -> int:
    total = 0
    for p in range(partitions):
        value = await redis.hget(counters_key(RUN, p), name)
        total += int(value or 0)
    return total


@dataclass
class FakeVllm:
    """Records every weight-sync call per server; ``fail[(host, path)]`` makes a step fail
    with that HTTP status, or with a connection error when the status is 0."""

    calls: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    bodies: dict[tuple[str, str], object] = field(default_factory=dict)
    fail: dict[tuple[str, str], int] = field(default_factory=dict)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    adapters: dict[str, set[str]] = field(default_factory=dict)
    """The LoRA adapters each server holds (``/v1/load_lora_adapter``, ``/v1/models``)."""
    aborted: dict[str, int] = field(default_factory=dict)
    """Set: ``/metrics`` (read around each sync, not recorded in ``calls``) says the server
    aborted that many requests so far, each ``/pause?mode=abort`` adding one."""

    def handle(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        query = request.url.query.decode()
        if path == "/metrics":
            if host not in self.aborted:
                return httpx.Response(404, json={"detail": "Not Found"})
            return httpx.Response(200, text=(
                '# TYPE vllm:request_success_total counter\n'
                f'vllm:request_success_total{{engine="0",finished_reason="abort",'
                f'model_name="m"}} {float(self.aborted[host])}\n'
                'vllm:request_success_total{engine="0",finished_reason="stop",'
                'model_name="m"} 7.0\n'))
        if path == "/pause" and query == "mode=abort" and host in self.aborted:
            self.aborted[host] += 1
        self.calls[host].append(path + (f"?{query}" if query else ""))
        if request.content:
            self.bodies[(host, path)] = json.loads(request.content)
        status = self.fail.get((host, path))
        if status == 0:
            raise httpx.ConnectError("connection refused", request=request)
        if status:
            return httpx.Response(status, json={"error": {"message": f"{path} broke",
                                                          "type": "InternalServerError"}})
        if path == "/v1/load_lora_adapter":  # vLLM answers a plain-text 200
            self.adapters.setdefault(host, set()).add(self.bodies[(host, path)]["lora_name"])  # type: ignore[index]
            return httpx.Response(200, text="Success: LoRA adapter loaded.")
        if path == "/v1/unload_lora_adapter":
            self.adapters.setdefault(host, set()).discard(
                self.bodies[(host, path)]["lora_name"])  # type: ignore[index]
            return httpx.Response(200, text="Success: LoRA adapter unloaded.")
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": name} for name in ["base", *sorted(self.adapters.get(host, ()))]]})
        replies: dict[str, object] = {
            "/pause": {"status": "paused"}, "/resume": {"status": "resumed"},
            "/collective_rpc": {"results": [None]}, "/reset_prefix_cache": {"success": True},
            "/update_weight_version": {"success": True},
        }
        return httpx.Response(200, json=replies.get(path, {"detail": "Not Found"}))
