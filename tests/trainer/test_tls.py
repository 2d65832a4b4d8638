"""The trainer SDK over TLS with a private CA (issue 34: ``SyncTrainerClient(url)`` ignored
``ROLLQ_REDIS_CA_FILE`` and failed with CERTIFICATE_VERIFY_FAILED): the CA from its
settings, from the roles' variable, or from the URL's query; without it, one clear
configuration error instead of an outage."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import quote

import pytest
import redis.asyncio as aioredis

from rollq.consumers.trainer import SyncTrainerClient, TrainerClientSettings
from rollq.schemas import ConfigError
from tests.factories import make_group
from tests.redis_tls import TlsRedis
from tests.trainer.helpers import RUN, publish_scored


def fast(redis_ca_file: str | None = None, redis_give_up_s: float = 300.0
         ) -> TrainerClientSettings:
    return TrainerClientSettings(block_ms=100, prefetch=False, redis_ca_file=redis_ca_file,
                                 redis_give_up_s=redis_give_up_s)


async def published(tls: TlsRedis, count: int = 2) -> None:
    redis = aioredis.Redis.from_url(tls.url(), ssl_ca_certs=str(tls.ca))
    await redis.flushall()
    for i in range(count):
        await publish_scored(redis, make_group(run=RUN, group_id=f"tls{i}", seed=i))
    await redis.aclose()


def trained(url: str, settings: TrainerClientSettings) -> list[str]:
    with SyncTrainerClient(url, run=RUN, consumer="t0", settings=settings) as client:
        batch = client.next_batch(groups=2, timeout_s=20)
        batch.ack()
        return sorted(batch.group_ids)


async def test_the_sdk_takes_the_ca_from_its_settings(tls_redis: TlsRedis) -> None:
    await published(tls_redis)
    settings = fast(redis_ca_file=str(tls_redis.ca))
    assert await asyncio.to_thread(trained, tls_redis.url(), settings) == ["tls0", "tls1"]


async def test_the_sdk_reads_the_roles_variables(tls_redis: TlsRedis,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    await published(tls_redis)
    monkeypatch.setenv("ROLLQ_REDIS_CA_FILE", str(tls_redis.ca))
    settings = fast()
    assert await asyncio.to_thread(trained, tls_redis.url(), settings) == ["tls0", "tls1"]


async def test_the_sdk_honours_the_urls_tls_options(tls_redis: TlsRedis) -> None:
    await published(tls_redis)
    url = f"{tls_redis.url()}?ssl_ca_certs={quote(str(tls_redis.ca))}"
    settings = fast()
    assert await asyncio.to_thread(trained, url, settings) == ["tls0", "tls1"]


async def test_without_the_ca_the_sdk_names_the_setting(tls_redis: TlsRedis,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLQ_REDIS_CA_FILE", raising=False)
    settings = fast(redis_give_up_s=300)
    with pytest.raises(ConfigError, match=r"TLS to Redis failed.*redis_ca_file"):
        await asyncio.wait_for(asyncio.to_thread(trained, tls_redis.url(), settings), 30)


def test_a_tls_option_redis_py_does_not_know_is_refused(tmp_path: Path) -> None:
    settings = fast()
    with pytest.raises(ConfigError, match="'ssl_ca_cert' is not one rollq honours"):
        SyncTrainerClient("rediss://127.0.0.1:1/0?ssl_ca_cert=/ca.pem", run=RUN,
                          consumer="t0", settings=settings)
