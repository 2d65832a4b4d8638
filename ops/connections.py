"""Redis connections of every role, built from the settings in one place.

``rediss://`` URLs use TLS with the CA bundle, client certificate and key the settings name
(``redis_ca_file``, ``redis_cert_file``, ``redis_key_file``; ``redis_tls_verify``), and the
URL's user and password log in as an ACL user. ``redis_options`` is the keyword arguments
redis-py takes for them; the worker pool hands the same options to arq, whose own URL parser
would drop them.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from ops.settings import CommonSettings


def redis_options(settings: CommonSettings) -> dict[str, Any]:
    """redis-py keyword arguments for the settings' TLS options (empty for plain TCP)."""
    if not settings.redis_url.startswith("rediss://"):
        return {}
    options: dict[str, Any] = {"ssl_cert_reqs": "required" if settings.redis_tls_verify
                               else "none"}
    if settings.redis_ca_file is not None:
        options["ssl_ca_certs"] = str(settings.redis_ca_file)
    if settings.redis_cert_file is not None:
        options["ssl_certfile"] = str(settings.redis_cert_file)
    if settings.redis_key_file is not None:
        options["ssl_keyfile"] = str(settings.redis_key_file)
    return options


def open_redis(settings: CommonSettings, **extra: Any) -> aioredis.Redis:
    """An asyncio client for the settings' Redis (closed by the caller)."""
    client: aioredis.Redis = aioredis.Redis.from_url(
        settings.redis_url, **{"socket_connect_timeout": 5, **redis_options(settings),
                               **extra})
    return client
