"""Every role's /metrics parses with prometheus_client's own parser and counts what happened."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from bench.fake_vllm import REPO_ROOT, FakeServerProcess
from rollq.consumers.trainer import TrainerClient, TrainerClientSettings
from rollq.ops.atropos.app import create_app as create_atropos_app
from rollq.ops.cli import main
from rollq.ops.gateway.app import create_app as create_gateway_app
from rollq.ops.health import parse_health
from rollq.ops.local.stack import free_port
from rollq.ops.metrics import RoleMetrics
from rollq.ops.role_metrics import serve_trainer_metrics
from rollq.ops.roles import run_scorer
from rollq.ops.settings import AtroposApiSettings, GatewaySettings, ScorerSettings
from rollq.producers.publisher import Publisher
from rollq.schemas import decode_trajectory
from rollq.schemas.keys import stream_key
from tests.atropos.helpers import REGISTRATION, atropos_group, env_registration
from tests.factories import make_group
from tests.producers.fake_vllm import FakeVLLM, fake_transport
from tests.redis_server import RedisServer

RUN = "metrics"
DASHBOARD = Path(__file__).resolve().parent.parent / "ops/monitoring/grafana/dashboards/rollq.json"


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


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
        for _ in range(10_000):  # a condition, not a clock: the per-test timeout bounds it
            if (await real_redis.xlen(stream_key(RUN, 0, "scored")) == 4
                    and await real_redis.xlen(stream_key(RUN, 0, "dead")) == 1
                    and any(e["event"] == "metrics_serving" for e in logs)):
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


def test_dashboard_is_valid_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "rollq" and dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"] and all(t["expr"] for t in panel["targets"])
    assert {"run"} == {v["name"] for v in dashboard["templating"]["list"]}


@pytest.mark.parametrize("port", [None])
def test_metrics_off_by_default(port: int | None) -> None:
    assert ScorerSettings().metrics_port is port


@pytest.fixture(scope="module")
def inference() -> Iterator[str]:
    """A loopback OpenAI-compatible fake (real HTTP), waited for by condition: on a loaded
    machine its start-up can take longer than ``FakeServerProcess.start`` allows."""
    fake = FakeServerProcess()
    fake.process = subprocess.Popen(
        [sys.executable, "-m", "bench.workers", "--serve-fake", str(fake.port)],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        while fake.process.poll() is None:
            try:
                if httpx.get(fake.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert fake.process.poll() is None, "the fake vLLM server exited"
        yield fake.url
    finally:
        fake.stop()


SCRAPED: list[str] = []
"""Every exposition ``scrape`` read (the dashboard check looks at what they declare)."""


async def scrape(port: int) -> Samples:
    async with httpx.AsyncClient() as client:
        reply = await client.get(f"http://127.0.0.1:{port}/metrics")
    assert reply.status_code == 200
    SCRAPED.append(reply.text)
    return samples(reply.text)


def declared(text: str) -> set[str]:
    """Names a query may use: every sample's, and every family's (a family without samples
    yet, like drops before the first drop, is declared all the same)."""
    names = {name for name, _ in samples(text)}
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names


async def scrape_until(port: int, name: str, expected: float, **labels: str) -> Samples:
    """Scrape until ``name{labels}`` reads ``expected`` (the roles run in other processes)."""
    found: Samples = {}
    for _ in range(600):
        try:
            found = await scrape(port)
        except httpx.TransportError:  # the role is still starting
            await asyncio.sleep(0.1)
            continue
        matches = [v for (n, ls), v in found.items()
                   if n == name and set(labels.items()) <= set(ls)]
        if matches == [expected]:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name}{labels} never read {expected}: {found}")


async def status_json(url: str, run: str) -> dict[str, object]:
    """``rollq status --json`` (its own event loop, in a thread)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = await asyncio.to_thread(main, ["status", "--redis-url", url, "--run", run,
                                              "--json"], {})
    assert code == 0
    document: dict[str, object] = json.loads(out.getvalue())
    return document


@pytest.mark.slow
async def test_every_role_serves_metrics_that_count_what_happened(
        real_redis: aioredis.Redis, redis_server: RedisServer, inference: str,
        tmp_path: Path) -> None:
    """feed, workers and score as the CLI runs them (processes, --metrics-port), the trainer
    SDK in this process: 4 groups admitted (the budget at version 0: 1 x 4), generated,
    scored and trained; every endpoint parses and counts them."""
    run = "metricsall"
    config = tmp_path / "reward.yaml"
    config.write_text("components:\n  - name: length\n    component: length_bounty\n"
                      "advantages: {zero_variance: keep}\n")
    ports = {role: free_port() for role in ("feeder", "workers", "scorer")}
    env = {**os.environ, "ROLLQ_REDIS_URL": redis_server.url, "ROLLQ_RUN": run,
           "ROLLQ_LOG_FORMAT": "json"}
    argv = {"feeder": ["feed", "--batch-groups", "4", "--max-staleness", "0"],
            "workers": ["workers", "--inference", inference, "--group-size", "2",
                        "--max-tokens", "8", "--concurrency", "2"],
            "scorer": ["score", "--reward-config", str(config), "--processes", "1"]}
    processes = {role: await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq", *argv[role], "--metrics-port", str(ports[role]),
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        for role in ports}
    try:
        async with TrainerClient(real_redis, run=run, consumer="t0",
                                 settings=TrainerClientSettings(block_ms=100)) as client:
            endpoint, trainer_port = serve_trainer_metrics(client, 0,
                                                           redis_url=redis_server.url)
            try:
                batch = await client.next_batch(groups=4, timeout_s=90)
                assert len(batch) == 4
                await batch.ack()
                trainer = await scrape(trainer_port)
            finally:
                endpoint.close()
        # the feeder's next check sees the batch consumed: nothing outstanding, no budget
        feeder = await scrape_until(ports["feeder"], "rollq_admission_outstanding", 0)
        # arq counts a job complete just after its body returned (the group published)
        workers = await scrape_until(ports["workers"], "rollq_worker_jobs_total", 4,
                                     outcome="complete")
        scorer = await scrape(ports["scorer"])
        health = (await status_json(redis_server.url, run))["workers"]
    finally:
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        codes = {role: await asyncio.wait_for(p.wait(), 60) for role, p in processes.items()}
    assert codes == dict.fromkeys(processes, 0)

    groups = [decode_trajectory(f) for _, f in
              await real_redis.xrange(stream_key(run, 0, "traj"))]
    tokens = sum(len(c.completion_ids) for g in groups for c in g.completions)
    assert len(groups) == 4 and tokens > 0
    for role, found in (("feeder", feeder), ("workers", workers), ("scorer", scorer),
                        ("trainer", trainer)):
        assert value(found, "rollq_role_info", role=role) == 1
        assert value(found, "rollq_groups_total", stage="admitted", run=run) == 4
    assert value(feeder, "rollq_feeder_jobs_admitted_total") == 4
    assert value(feeder, "rollq_admission_budget") == 0
    assert value(feeder, "rollq_feeder_cursor") == 4
    assert value(workers, "rollq_worker_groups_total", outcome="published") == 4
    assert value(workers, "rollq_worker_groups_total", outcome="dead_lettered") == 0
    assert value(workers, "rollq_worker_jobs_total", outcome="complete") == 4
    assert value(workers, "rollq_worker_jobs_running") == 0
    assert value(workers, "rollq_worker_job_slots") == 2
    assert value(workers, "rollq_workers_alive") == 1  # its own health record
    server = inference.rstrip("/")
    assert value(workers, "rollq_inference_completion_tokens_total", server=server) == tokens
    assert value(workers, "rollq_inference_request_seconds_count", server=server) == 4
    assert value(workers, "rollq_inference_request_seconds_bucket", server=server,
                 le="+Inf") == 4
    assert value(workers, "rollq_inference_server_up", server=server) == 1
    assert value(scorer, "rollq_stage_entries_total", outcome="forwarded") == 4
    assert value(scorer, "rollq_groups_total", stage="scored") == 4
    assert value(trainer, "rollq_trainer_groups_consumed_total") == 4
    assert value(trainer, "rollq_trainer_batches_total") == 1
    assert value(trainer, "rollq_trainer_tokens_total") == tokens + sum(  # + each sequence's prompt
        len(g.prompt_ids) * len(g.completions) for g in groups)
    assert value(trainer, "rollq_trainer_step_seconds_count") == 1
    assert value(trainer, "rollq_trainer_staleness_versions_bucket", le="0.0") == 4
    assert value(trainer, "rollq_groups_total", stage="consumed") == 4
    assert isinstance(health, dict) and health["alive"] == 1  # arq's health record
    after = (await status_json(redis_server.url, run))["workers"]
    assert isinstance(after, dict) and after["alive"] == 0  # a stopped worker deletes it
    # The provisioned dashboard only queries series that some role really serves.
    exposed = set().union(*map(declared, SCRAPED))
    queried = set(re.findall(r"\b((?:rollq|process)_[a-z_]+)", DASHBOARD.read_text()))
    assert queried and queried <= exposed, queried - exposed


def test_arq_health_records_are_summed() -> None:
    records = [b"Nov-24 05:31:02 j_complete=12 j_failed=1 j_retried=3 j_ongoing=4 queued=20",
               b"Nov-24 05:31:05 j_complete=5 j_failed=0 j_retried=0 j_ongoing=2 queued=19",
               None]  # expired between SCAN and GET
    health = parse_health(records)
    assert (health.alive, health.complete, health.failed, health.retried, health.running,
            health.queued) == (2, 17, 1, 3, 6, 20)


async def test_the_http_roles_answer_metrics_on_their_own_port(
        real_redis: aioredis.Redis, redis_server: RedisServer) -> None:
    """The Atropos API and the gateway serve ``GET /metrics`` beside their routes."""
    run = "httpmetrics"
    api = create_atropos_app(AtroposApiSettings(run=run, redis_url=redis_server.url),
                             redis=real_redis)
    async with api.router.lifespan_context(api), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=api), base_url="http://atropos.test") as client:
        await client.post("/register", json=REGISTRATION)
        await client.post("/register-env", json=env_registration())
        for marker in (1, 2, 3):
            assert (await client.post("/scored_data",
                                      json=atropos_group(marker))).status_code == 200
        reply = await client.get("/metrics")
    assert reply.status_code == 200
    found = samples(reply.text)
    assert value(found, "rollq_role_info", role="atropos-api", run=run) == 1
    assert value(found, "rollq_stream_entries", stream="scored", partition="0") == 3
    assert value(found, "rollq_redis_up") == 1

    fake = FakeVLLM()
    gateway = create_gateway_app(GatewaySettings(inference=[fake.base_url], model="rollq-tiny"),
                                 transport=fake_transport(fake))
    async with gateway.router.lifespan_context(gateway), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=gateway), base_url="http://gw.test") as client:
        episode = (await client.post("/episodes")).json()["episode_id"]
        answer = (await client.post(f"/episodes/{episode}/v1/completions", json={
            "model": "rollq-tiny", "prompt": "2+2=", "max_tokens": 8,
            "return_token_ids": True})).json()
        await client.post(f"/episodes/{episode}/close")
        await client.post("/episodes")  # left open
        reply = await client.get("/metrics")
    found = samples(reply.text)
    server = fake.base_url.rstrip("/")
    assert value(found, "rollq_role_info", role="gateway") == 1
    assert value(found, "rollq_gateway_episodes") == 1
    assert value(found, "rollq_gateway_episodes_total", outcome="opened") == 2
    assert value(found, "rollq_gateway_episodes_total", outcome="closed") == 1
    assert value(found, "rollq_inference_request_seconds_count", server=server) == 1
    assert value(found, "rollq_inference_completion_tokens_total", server=server) == len(
        answer["choices"][0]["token_ids"])
    assert not any(name == "rollq_redis_up" for name, _ in found)  # it uses no Redis


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "redis+cluster://127.0.0.1:1"])
def test_a_scrape_while_redis_is_away_reports_it_instead_of_failing(url: str) -> None:
    metrics = RoleMetrics("scorer", run="away", redis_url=url, queue_url="redis://127.0.0.1:1/0")
    found = samples(metrics.render().decode())
    assert value(found, "rollq_redis_up", run="away") == 0
    assert value(found, "rollq_role_info", role="scorer") == 1
