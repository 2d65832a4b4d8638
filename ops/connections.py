"""Redis connections of every role, built from the settings in one place.

Two planes (docs/operations.md, "Scaling past one Redis node"):

- **Data plane** (``redis_url``): the run's streams, counters and state, all under rollq's
  hash tags. ``redis://`` / ``rediss://`` name one server; ``redis+cluster://`` /
  ``rediss+cluster://`` name any node of a Redis Cluster (``ops.cluster.ClusterClient``).
- **Control plane** (``queue_url``): arq's job queue, whose keys are not hash-tagged and
  which has no cluster support: always one plain server. Default: ``redis_url`` when that is
  not a cluster; a cluster ``redis_url`` needs an explicit ``queue_url``.

``rediss://`` URLs use TLS with the CA bundle, client certificate and key the settings name
(``redis_ca_file``, ``redis_cert_file``, ``redis_key_file``; ``redis_tls_verify``), and the
URL's user and password log in as an ACL user. ``redis_options`` is the keyword arguments
redis-py takes for them; the worker pool hands the same options to arq, whose own URL parser
would drop them. The same options can ride in the URL's query (``?ssl_ca_certs=…``):
every connection honours them alike (``schemas.tls``).
"""

from __future__ import annotations

from typing import Any, cast
from urllib.parse import urlsplit

import redis.asyncio as aioredis

from rollq.ops.cluster import ClusterClient
from rollq.ops.settings import CommonSettings
from rollq.schemas import ConfigError
from rollq.schemas.errors import refusals_named
from rollq.schemas.tls import RedisTls

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
"""rollq's URL schemes for a Redis Cluster, and the plain scheme of their nodes."""


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://``, ``rediss+cluster://``)."""
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def redis_tls(settings: CommonSettings) -> RedisTls:
    """The settings' TLS files and verification (``redis_ca_file`` and friends)."""
    return RedisTls(ca_file=settings.redis_ca_file, cert_file=settings.redis_cert_file,
                    key_file=settings.redis_key_file, verify=settings.redis_tls_verify)


def redis_options(settings: CommonSettings, url: str | None = None) -> dict[str, Any]:
    """redis-py keyword arguments for the settings' TLS options (empty for plain TCP), for
    ``url`` (default: ``redis_url``); the URL's own ``ssl_*`` query options, which redis-py
    reads itself, are checked here (``schemas.tls``)."""
    return redis_tls(settings).options(settings.redis_url if url is None else url)


class RefusalNamingRedis(aioredis.Redis):
    """A redis-py client whose refused commands (ACL ``NOPERM``, ``WRONGPASS``) raise
    ``AccessRefused`` naming the user, the command and its keys: Redis's own text names
    none of them, and a refusal must end the role (exit 78), not be ridden out."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        with refusals_named(self.connection_pool.connection_kwargs.get("username"), args):
            return await super().execute_command(  # type: ignore[no-untyped-call]
                *args, **options)  # (redis-py leaves it untyped)


def open_redis(settings: CommonSettings, **extra: Any) -> aioredis.Redis:
    """An asyncio client for the data plane (closed by the caller): a ``ClusterClient``
    when ``redis_url`` names a cluster."""
    return open_url(settings.redis_url, settings, **extra)


def open_url(url: str, settings: CommonSettings | None = None, **extra: Any) -> aioredis.Redis:
    """An asyncio client for ``url`` (a plain or a cluster URL), with the TLS options and
    ``wait_replicas`` of ``settings`` when given."""
    options = {"socket_connect_timeout": 5,
               **(redis_options(settings, url) if settings else {}), **extra}
    scheme = urlsplit(url).scheme
    if scheme not in CLUSTER_SCHEMES:
        plain: aioredis.Redis = RefusalNamingRedis.from_url(url, **options)
        return plain
    node_url = CLUSTER_SCHEMES[scheme] + url[len(scheme):]
    cluster = ClusterClient.from_url(node_url, **options)
    if settings is not None:
        cluster.wait_replicas = settings.wait_replicas
        cluster.wait_timeout_ms = settings.wait_timeout_ms
    # The roles and the SDK are typed against redis.asyncio.Redis; a RedisCluster speaks
    # the same commands (and ClusterClient the same pipelines), but is not its subclass.
    return cast(aioredis.Redis, cluster)


def queue_url(settings: CommonSettings) -> str:
    """The control plane's URL: ``queue_url``, else ``redis_url`` when it is one server."""
    if settings.queue_url is not None:
        if is_cluster_url(settings.queue_url):
            raise ConfigError("queue_url must name one Redis server, not a cluster: arq's "
                              "keys are not hash-tagged")
        return settings.queue_url
    if is_cluster_url(settings.redis_url):
        raise ConfigError("redis_url names a Redis Cluster, which cannot hold arq's job "
                          "queue: set queue_url to a plain Redis server (redis://host:port/0)")
    return settings.redis_url


def queue_options(settings: CommonSettings) -> dict[str, Any]:
    """``redis_options`` for the control plane's URL."""
    return redis_options(settings, queue_url(settings))


def open_queue_redis(settings: CommonSettings, **extra: Any) -> aioredis.Redis:
    """A plain asyncio client for the control plane (closed by the caller)."""
    return open_url(queue_url(settings), settings, **extra)
