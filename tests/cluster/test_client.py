"""The cluster client and the bus on a real local Redis Cluster (3 masters + 3 replicas):
single-slot transactions, per-partition reads that keep the batching, the exactly-once
forward across partitions, WAIT durability; and the control-plane settings."""

from __future__ import annotations

import time
import uuid

import pytest
import redis.exceptions as redis_errors
from redis.asyncio.cluster import ClusterNode
from redis.cluster import key_slot

from rollq.consumers.bus import ReaderSettings, StreamReader, is_cluster, trim_streams
from rollq.ops.cluster import ClusterClient
from rollq.ops.connections import is_cluster_url, open_redis, queue_url
from rollq.ops.local.cluster import LocalCluster
from rollq.ops.settings import CommonSettings
from rollq.producers.publisher import Publisher
from rollq.schemas import ConfigError
from rollq.schemas.keys import counters_key, stream_keys
from tests.factories import make_group
from tests.waiting import until

PARTITIONS = 6


def _client(cluster: LocalCluster, **values: object) -> ClusterClient:
    client = open_redis(CommonSettings(redis_url=cluster.url, **values))  # type: ignore[arg-type]
    assert is_cluster(client) and isinstance(client, ClusterClient)
    return client


async def test_partitions_spread_over_every_master(redis_cluster: LocalCluster) -> None:
    client = _client(redis_cluster)
    try:
        await client.initialize()
        run = f"spread-{uuid.uuid4().hex[:6]}"
        keys = stream_keys(run, 24, "traj")
        masters = {client.get_node_from_key(k).port for k in keys}
        assert masters == set(redis_cluster.primaries())
        # every key of a partition shares its slot: one script may touch them all
        assert {key_slot(k.encode()) for k in (keys[0], counters_key(run, 0))} == {
            key_slot(keys[0].encode())}
    finally:
        await client.aclose()


async def test_a_transaction_keeps_to_one_slot(redis_cluster: LocalCluster) -> None:
    client = _client(redis_cluster)
    run = f"tx-{uuid.uuid4().hex[:6]}"
    try:
        pipe = client.pipeline(transaction=True)
        pipe.hincrby(counters_key(run, 0), "scored", 2)
        pipe.hget(counters_key(run, 0), "scored")
        assert await pipe.execute() == [2, b"2"]
        pipe = client.pipeline(transaction=True)
        pipe.hincrby(counters_key(run, 0), "scored", 1)
        pipe.hincrby(counters_key(run, 1), "scored", 1)
        with pytest.raises(redis_errors.RedisClusterException, match="one hash slot"):
            await pipe.execute()
        assert await client.hget(counters_key(run, 1), "scored") is None  # nothing was sent
    finally:
        await client.aclose()


async def test_readers_read_every_partition_in_batches_and_forward_once(
        redis_cluster: LocalCluster) -> None:
    client = _client(redis_cluster)
    run = f"read-{uuid.uuid4().hex[:6]}"
    try:
        publisher = Publisher(client, run, PARTITIONS)
        for i in range(30):
            await publisher.publish(make_group(run=run, group_id=f"g{i}"))
        traj = stream_keys(run, PARTITIONS, "traj")
        first = StreamReader(client, traj, "scorers", "a", ReaderSettings(count=16))
        second = StreamReader(client, traj, "scorers", "b", ReaderSettings(count=16))
        await first.ensure_groups()
        batch = await first.read()
        # one batch from several partitions, no more than count + partitions - 1
        assert 16 <= len(batch) < 16 + PARTITIONS
        assert len({d.stream for d in batch}) > 1
        rest = await first.read(count=100)
        assert len(batch) + len(rest) == 30
        # both consumers forward the same entries (as after a reclaim): each goes once
        won_a = await first.forward_many([(d, {b"run": run.encode()}) for d in batch + rest],
                                         "scored", "scored")
        won_b = await second.forward_many([(d, {b"run": run.encode()}) for d in batch + rest],
                                          "scored", "scored")
        assert all(won_a) and not any(won_b)
        scored = stream_keys(run, PARTITIONS, "scored")
        assert sum([await client.xlen(k) for k in scored]) == 30
        counted = [await client.hget(counters_key(run, p), "scored") for p in range(PARTITIONS)]
        assert sum(int(c or 0) for c in counted) == 30
        assert await trim_streams(client, traj) == 30  # all scored: the traj entries go
        # a blocking read over empty partitions waits, then returns nothing
        started = time.monotonic()
        assert await first.read(block_ms=300) == []
        assert time.monotonic() - started >= 0.25
    finally:
        await client.aclose()


async def test_wait_replicas_waits_for_a_replica(redis_cluster: LocalCluster) -> None:
    client = _client(redis_cluster, wait_replicas=1)
    run = f"wait-{uuid.uuid4().hex[:6]}"
    try:
        key = stream_keys(run, 1, "traj")[0]
        await client.xadd(key, {"v": "1"})
        pipe = client.pipeline(transaction=True)
        pipe.xadd(key, {"v": "2"})
        pipe.hincrby(counters_key(run, 0), "scored", 1)
        await pipe.execute()
        node = client.get_node_from_key(key)
        assert node.port in redis_cluster.primaries()
        # two replicas cannot acknowledge it: each master has one
        client.wait_replicas, client.wait_timeout_ms = 2, 50
        with pytest.raises(redis_errors.ConnectionError, match="not acknowledged"):
            await client.xadd(key, {"v": "3"})
    finally:
        await client.aclose()


async def _slot_nodes(client: ClusterClient, key: str) -> list[ClusterNode]:
    """The client's map of ``key``'s slot (its master, then its replica), read again until
    it names the replica: a new cluster's nodes learn of their replicas by gossip."""
    async def read_again() -> list[ClusterNode] | None:
        await client.aclose()
        await client.initialize()
        nodes: list[ClusterNode] = client.nodes_manager.slots_cache[key_slot(key.encode())]
        return nodes if len(nodes) == 2 else None

    nodes: list[ClusterNode] = await until(read_again, "the slot map to name the replica",
                                           timeout_s=30, every_s=0.1)
    return nodes


async def test_a_write_sent_to_a_master_a_failover_made_a_replica_is_redirected(
        redis_cluster: LocalCluster) -> None:
    """A client whose slot map predates a failover sends writes and WAIT to the old master,
    now a replica: the writes come back MOVED and go to the new master; the replica's
    refusal of WAIT ("WAIT cannot be used with replica instances") is no error of its own.
    The failover is made stale on the client's side (its map names the replica first),
    the same bytes on the wire as a real one."""
    client = _client(redis_cluster, wait_replicas=1)
    run = f"stale-{uuid.uuid4().hex[:6]}"
    try:
        key = stream_keys(run, 1, "traj")[0]
        await client.xadd(key, {"v": "1"})
        for write in ("single", "transaction"):
            nodes = await _slot_nodes(client, key)
            assert nodes[1].port not in redis_cluster.primaries()
            nodes.reverse()  # the map names the replica as the slot's master
            if write == "single":
                await client.xadd(key, {"v": "2"})
            else:
                pipe = client.pipeline(transaction=True)
                pipe.xadd(key, {"v": "3"})
                pipe.hincrby(counters_key(run, 0), "scored", 1)
                await pipe.execute()
            master = client.get_node_from_key(key)
            assert master.port in redis_cluster.primaries()  # the map was read again
        assert [f[b"v"] for _, f in await client.xrange(key)] == [b"1", b"2", b"3"]
    finally:
        await client.aclose()


def test_the_queue_lives_on_one_plain_server() -> None:
    plain = CommonSettings(redis_url="redis://h:1/0")
    assert queue_url(plain) == "redis://h:1/0"
    cluster = CommonSettings(redis_url="redis+cluster://h:1", queue_url="redis://q:2/0")
    assert is_cluster_url(cluster.redis_url) and queue_url(cluster) == "redis://q:2/0"
    with pytest.raises(ConfigError, match="queue_url"):
        queue_url(CommonSettings(redis_url="rediss+cluster://h:1"))
    with pytest.raises(ConfigError, match="not a cluster"):
        queue_url(CommonSettings(redis_url="redis://h:1", queue_url="redis+cluster://q:2"))
