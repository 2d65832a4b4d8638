"""Every role's /metrics parses with prometheus_client's own parser and counts what happened."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from ops.roles import run_scorer
from ops.settings import ScorerSettings
from producers.publisher import Publisher
from schemas.keys import stream_key
from tests.factories import make_group
from tests.redis_server import RedisServer

RUN = "metrics"
DASHBOARD = Path(__file__).resolve().parent.parent / "ops/monitoring/grafana/dashboards/rollq.json"


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    matches = [v for (n, ls), v in found.items()
               if n == name and set(labels.items()) <= set(ls)]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


async def test_scorer_metrics_count_what_happened(real_redis: aioredis.Redis,
                                                  redis_server: RedisServer,
                                                  tmp_path: Path) -> None:
    for i in range(4):
        await Publisher(real_redis, RUN).publish(make_group(run=RUN, group_id=f"g{i}"))
    await real_redis.xadd(stream_key(RUN, 0, "traj"), {b"v": b"9", b"kind": b"traj"})
    config = tmp_path / "reward.yaml"
    config.write_text("components:\n  - name: length\n    component: length_bounty\n"
                      "advantages: {zero_variance: keep}\n")
    settings = ScorerSettings(redis_url=redis_server.url, run=RUN, reward_config=config,
                              metrics_port=0, block_ms=100)
    stop = asyncio.Event()
    with capture_logs() as logs:
        task = asyncio.create_task(run_scorer(settings, stop))
        for _ in range(200):
            if await real_redis.xlen(stream_key(RUN, 0, "scored")) == 4 and any(
                    e["event"] == "metrics_serving" for e in logs):
                break
            await asyncio.sleep(0.05)
        port = next(e["port"] for e in logs if e["event"] == "metrics_serving")
        async with httpx.AsyncClient() as client:
            reply = await client.get(f"http://127.0.0.1:{port}/metrics")
        stop.set()
        await asyncio.wait_for(task, 30)
    assert reply.status_code == 200
    found = samples(reply.text)
    assert value(found, "rollq_stage_entries_total", outcome="forwarded", role="scorer") == 4
    assert value(found, "rollq_stage_entries_total", outcome="dead_lettered") == 1
    assert value(found, "rollq_groups_total", stage="scored", run=RUN) == 4
    assert value(found, "rollq_groups_dropped_total", reason="unknown_version_error") == 1
    assert value(found, "rollq_stream_entries", stream="traj", partition="0") == 5
    assert value(found, "rollq_consumer_group_pending", stream="traj", group="scorers") == 0
    assert value(found, "rollq_redis_up", run=RUN) == 1
    assert value(found, "rollq_reward_component_mean", component="length") > 0
    assert value(found, "rollq_event_loop_lag_seconds", role="scorer") >= 0
    assert value(found, "process_resident_memory_bytes") > 0
    # The provisioned dashboard only queries series that a role really serves.
    exposed = {name for name, _ in found}
    queried = set(re.findall(r"\b((?:rollq|process)_[a-z_]+)", DASHBOARD.read_text()))
    assert queried and queried <= exposed, queried - exposed


def test_dashboard_is_valid_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "rollq" and dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"] and all(t["expr"] for t in panel["targets"])
    assert {"run"} == {v["name"] for v in dashboard["templating"]["list"]}


@pytest.mark.parametrize("port", [None])
def test_metrics_off_by_default(port: int | None) -> None:
    assert ScorerSettings().metrics_port is port
