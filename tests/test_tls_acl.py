"""Every role over TLS (a test CA) as an ACL user limited to the run's keys: score, feed,
workers, the trainer SDK and status; the password never reaches a log line or a message."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from rollq.consumers.trainer import TrainerClient, TrainerClientSettings
from rollq.ops.cli import Exit, main
from rollq.ops.connections import open_redis
from rollq.ops.roles import run_feeder, run_scorer, run_workers
from rollq.ops.settings import CommonSettings, FeederSettings, ScorerSettings, WorkerSettings
from rollq.producers.worker import queue_name
from rollq.schemas.errors import AccessRefused
from rollq.schemas.keys import stream_key
from tests.producers.fake_vllm import FakeVLLM, fake_transport
from tests.redis_tls import TlsRedis

RUN = "tls"
PASSWORD = "role-pw-7ce1"
# The minimal ACL of each role (README: "TLS and ACL"): the run's own keys, arq's keys of
# the run's jobs for feed and workers, and the command categories they use.
RUN_KEYS = (f"~rollq:{{{RUN}}}:*", f"~rollq:{{{RUN}:*}}:*", "~rollq:runs")
JOB_KEYS = (*(f"~arq:{kind}:{RUN}:*" for kind in ("job", "result", "in-progress", "retry")),
            "~arq:abort")  # arq 0.28's one global key: its set of jobs to abort
COMMANDS = ("+@read", "+@write", "+@stream", "+@scripting", "+@transaction", "+@connection",
            "+@keyspace", "+@hash", "+@set", "+@sortedset", "+@string", "+info")
ROLES: dict[str, tuple[str, ...]] = {
    "scorer": RUN_KEYS, "trainer": RUN_KEYS, "status": RUN_KEYS,
    "feeder": (*RUN_KEYS, *JOB_KEYS), "workers": (*RUN_KEYS, *JOB_KEYS),
}


def settings(tls: TlsRedis, role: str, cls: type[Any] = CommonSettings, **values: Any) -> Any:
    tls.acl(role, PASSWORD, "resetkeys", *ROLES[role], "-@all", *COMMANDS)
    return cls(redis_url=tls.url(role, PASSWORD), run=RUN, redis_ca_file=tls.ca, **values)


@pytest.mark.slow
async def test_every_role_over_tls_with_least_privilege(tls_redis: TlsRedis,
                                                        tmp_path: Path) -> None:
    config = tmp_path / "reward.yaml"
    config.write_text("components:\n  - name: length\n    component: length_bounty\n"
                      "advantages: {zero_variance: keep}\n")
    admin = aioredis.Redis.from_url(tls_redis.url(), ssl_ca_certs=str(tls_redis.ca))
    await admin.flushall()
    with capture_logs() as logs:
        feeder = settings(tls_redis, "feeder", FeederSettings, epochs=1, batch_groups=6,
                          max_staleness=0, poll_s=0.05)
        stop = asyncio.Event()
        feeding = asyncio.create_task(run_feeder(feeder, stop))
        for _ in range(400):  # the budget at version 0: (0 + 0 + 1) × 6 jobs
            if await admin.zcard(queue_name(RUN)) == 6 or feeding.done():
                break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(feeding, 30)
        assert await admin.zcard(queue_name(RUN)) == 6
        fake = FakeVLLM()
        workers = settings(tls_redis, "workers", WorkerSettings, inference=[fake.base_url],
                           group_size=2, max_tokens=8)
        await asyncio.wait_for(run_workers(workers, burst=True, transport=fake_transport(fake)),
                               60)
        assert await admin.xlen(stream_key(RUN, 0, "traj")) == 6
        scorer = settings(tls_redis, "scorer", ScorerSettings, reward_config=config,
                          processes=1)
        stage = await run_scorer(scorer, asyncio.Event(), burst=True)
        assert stage.forwarded == 6
        trainer = settings(tls_redis, "trainer")
        redis = open_redis(trainer)
        async with TrainerClient(redis, run=RUN, consumer="t0",
                                 settings=TrainerClientSettings(block_ms=100)) as client:
            batch = await client.next_batch(groups=6, timeout_s=10)
            assert len(batch.groups) == 6
            await client.ack(batch)
        await redis.aclose()
    status = settings(tls_redis, "status")
    code = await asyncio.to_thread(main, ["status", "--redis-url", status.redis_url,
                                          "--run", RUN], {
        "ROLLQ_REDIS_CA_FILE": str(tls_redis.ca), "ROLLQ_LOG_FORMAT": "console"})
    assert code == Exit.OK
    assert all(PASSWORD not in str(entry) for entry in logs)
    await admin.aclose()


@pytest.mark.slow
async def test_feed_and_workers_honour_the_urls_tls_options(tls_redis: TlsRedis) -> None:
    """``?ssl_ca_certs=`` in the URL, no CA setting: feed admits and workers roll out
    (issue 34: feed exited 69 and workers ran forever without working, as arq's URL parser
    dropped the option)."""
    admin = aioredis.Redis.from_url(tls_redis.url(), ssl_ca_certs=str(tls_redis.ca))
    await admin.flushall()
    url = f"{tls_redis.url()}?ssl_ca_certs={quote(str(tls_redis.ca))}"
    feeder = FeederSettings(redis_url=url, run=RUN, epochs=1, batch_groups=2,
                            max_staleness=0, poll_s=0.05)
    stop = asyncio.Event()
    feeding = asyncio.create_task(run_feeder(feeder, stop))
    for _ in range(400):
        if await admin.zcard(queue_name(RUN)) == 2 or feeding.done():
            break
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(feeding, 30)
    fake = FakeVLLM()
    workers = WorkerSettings(redis_url=url, run=RUN, inference=[fake.base_url], group_size=2,
                             max_tokens=8)
    await asyncio.wait_for(run_workers(workers, burst=True, transport=fake_transport(fake)), 60)
    assert await admin.xlen(stream_key(RUN, 0, "traj")) == 2
    await admin.aclose()


@pytest.mark.parametrize("role", ["status", "feed", "workers"])
def test_a_certificate_that_does_not_verify_is_a_config_error(
        tls_redis: TlsRedis, role: str, capsys: pytest.CaptureFixture[str]) -> None:
    """No CA given: exit 78 naming the TLS settings, not 69 with "start a server"."""
    argv = [role, "--redis-url", tls_redis.url(), "--run", RUN]
    if role == "workers":
        argv += ["--inference", "http://127.0.0.1:9"]
    code = main(argv, {"ROLLQ_LOG_FORMAT": "console", "ROLLQ_REDIS_GIVE_UP_S": "300"})
    err = capsys.readouterr().err
    assert code == Exit.CONFIG, err
    assert "TLS to Redis failed" in err and "redis_ca_file" in err, err
    assert "start a server" not in err


async def test_a_role_outside_its_keys_is_refused(tls_redis: TlsRedis) -> None:
    scorer = settings(tls_redis, "scorer")
    redis = open_redis(scorer)
    with pytest.raises(AccessRefused, match=r"'scorer' the key pattern ~rollq:\{another-run:0"):
        await redis.xadd("rollq:{another-run:0}:traj", {"v": "1"})
    await redis.aclose()


def test_a_wrong_password_is_one_line_without_the_password(
        tls_redis: TlsRedis, capsys: pytest.CaptureFixture[str]) -> None:
    url = tls_redis.url("admin", "wrong-password-9f3")
    code = main(["status", "--redis-url", url, "--run", RUN],
                {"ROLLQ_REDIS_CA_FILE": str(tls_redis.ca), "ROLLQ_LOG_FORMAT": "console"})
    err = capsys.readouterr().err
    assert code == Exit.CONFIG, err
    assert "wrong-password-9f3" not in err and "Traceback" not in err

