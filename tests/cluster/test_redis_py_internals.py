"""The redis-py internals ``ops.cluster`` relies on are all there (no server needed).

This fails on a redis-py upgrade that moves one of them, naming it, before any cluster test
gets to misbehave during a failover."""

from __future__ import annotations

import pytest

from rollq.ops import cluster
from rollq.ops.cluster import REDIS_PY_INTERNALS, ClusterClient, missing_redis_py_internals


def test_every_redis_py_internal_the_cluster_client_uses_exists() -> None:
    assert missing_redis_py_internals() == []
    assert sum(map(len, REDIS_PY_INTERNALS.values())) >= 10


async def test_a_redis_py_without_them_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cluster, "_MISSING_INTERNALS", lambda: ["ClusterNode._free"])
    client = ClusterClient(host="127.0.0.1", port=6379)
    with pytest.raises(RuntimeError, match=r"ClusterNode\._free"):
        await client.initialize()  # before any connection is tried
