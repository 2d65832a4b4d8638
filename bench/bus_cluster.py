"""``python -m bench.bus --cluster``: rollq's bus on a local Redis Cluster vs one node.

The same workload as ``bench.bus``'s rollq variant (publish -> score stage -> trainer read,
default 16 x 2048-token groups), with ``--partitions`` partitions (default 6) on:

node     one redis-server (persistence off): the baseline, same partitions;
cluster  a local Redis Cluster of 3 masters + 3 replicas (``ops.local.cluster``, persistence
         off) through ``ops.cluster.ClusterClient``: per-partition reads, one MULTI per
         partition, asynchronous replication;
wait1    the cluster with ``wait_replicas=1``: every write waits for a replica (``WAIT``),
         so a failover cannot lose it.

Runs interleave the variants (order rotating) and report medians; the verdicts are ratios
taken run by run (cluster/node and wait1/cluster), medianed. All roles share this process's
loop, each on its own client, as in ``bench.bus --mode loop``. On one machine the cluster
cannot be faster (its six servers share the same cores): what the run shows is the cost of
the cluster client and how evenly the partitions spread over the masters (keys and bytes
per master after ``--buffered`` groups are published and scored). docs/operations.md:
"Scaling past one Redis node" turns these into the scaling model for N machines.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import redis.asyncio as aioredis

from bench.bus_workload import RUN, Result, _score_until, _stage, make_groups, run_rollq
from bench.common import BenchRedis, median_of, print_table
from rollq.ops.cluster import ClusterClient
from rollq.ops.connections import open_url
from rollq.ops.local.cluster import LocalCluster
from rollq.producers.publisher import Publisher
from rollq.schemas import TrajectoryGroup, encode
from rollq.schemas.keys import stream_keys


def _open(url: str, wait_replicas: int = 0) -> aioredis.Redis:
    client = open_url(url)
    if wait_replicas:
        cast(ClusterClient, client).wait_replicas = wait_replicas
    return client


async def _flush(client: aioredis.Redis) -> None:
    await client.flushall()  # a cluster client sends it to every master


async def run_partitioned(url: str, groups: list[TrajectoryGroup], batch: int, partitions: int,
                          wait_replicas: int = 0) -> Result:
    """bench.bus's rollq variant over ``partitions`` partitions of the server at ``url``."""
    return await run_rollq(url, groups, batch, partitions=partitions,
                           connect=lambda url: _open(url, wait_replicas))


async def distribution(cluster: LocalCluster, url: str, groups: list[TrajectoryGroup],
                       batch: int, partitions: int) -> list[list[Any]]:
    """Publish and score ``groups`` (nobody trains), then per master: its partitions, keys
    and the bytes its streams hold (``MEMORY USAGE``) and its ``used_memory``."""
    client = _open(url)
    try:
        await _flush(client)
        publisher = Publisher(client, RUN, partitions)
        await publisher.register()
        for group in groups:
            await publisher.publish(group)
        stage = _stage(client, batch, partitions)
        await stage.reader.ensure_groups()
        await _score_until(stage, len(groups))
        cluster_client = cast(ClusterClient, client)
        rows: list[list[Any]] = []
        for port in cluster.primaries():
            node = aioredis.Redis(host="127.0.0.1", port=port)
            try:
                keys = [k.decode() async for k in node.scan_iter(count=1000)]
                stream_bytes = sum([int(await node.memory_usage(k, samples=0) or 0)
                                    for k in keys])
                used = int((await node.info("memory"))["used_memory"])
            finally:
                await node.aclose()
            owned = sorted(p for p in range(partitions) if cluster_client.get_node_from_key(
                stream_keys(RUN, partitions, "traj")[p]).port == port)
            rows.append([f"127.0.0.1:{port}", ",".join(map(str, owned)) or "-", len(keys),
                         stream_bytes / 1e6, used / 1e6])
        await _flush(client)
        return rows
    finally:
        await client.aclose()


async def main_cluster(args: argparse.Namespace) -> int:
    partitions = args.partitions
    print(f"building {args.groups} groups of {args.group_size} x {args.seq_len} tokens ...",
          flush=True)
    groups = make_groups(args.groups, args.group_size, args.seq_len, args.text_bytes)
    traj_mb = median_of(sum(len(k) + len(v) for k, v in encode(g).items())
                        for g in groups[:8]) / 1e6
    with BenchRedis() as server, tempfile.TemporaryDirectory(prefix="rollq-bench-cl-") as tmp:
        cluster = LocalCluster(Path(tmp), appendonly=False).start()
        try:
            cluster_url = cluster.url
            print(f"redis-server {server.version()}; one node on :{server.port}; cluster of "
                  f"3 masters + 3 replicas on {cluster.live_ports()} (no persistence); "
                  f"python {sys.version.split()[0]}; {os.cpu_count()} CPUs; {partitions} "
                  f"partitions; traj entry {traj_mb:.3f} MB; batch {args.batch}\n", flush=True)
            variants: dict[str, Callable[[list[TrajectoryGroup]], Awaitable[Result]]] = {
                "node": lambda g: run_partitioned(server.url, g, args.batch, partitions),
                "cluster": lambda g: run_partitioned(cluster_url, g, args.batch, partitions),
                "wait1": lambda g: run_partitioned(cluster_url, g, args.batch, partitions,
                                                   wait_replicas=1),
            }
            warm = groups[: max(1, min(32, args.groups))]
            for run in variants.values():  # warm-up: connections, scripts, allocator
                await run(warm)
            results: dict[str, list[Result]] = {name: [] for name in variants}
            names = list(variants)
            for index in range(args.runs):
                order = names[index % 3:] + names[: index % 3]
                for name in order:
                    gc.collect()
                    result = await variants[name](groups)
                    results[name].append(result)
                    print(f"run {index + 1}/{args.runs} {name:8s} {result.seconds:7.3f} s  "
                          f"{result.groups_per_s:7.1f} groups/s", flush=True)
            print()
            rows = await distribution(cluster, cluster_url, groups[: args.buffered],
                                      args.batch, partitions)
        finally:
            cluster.stop()

    def paired(a: str, b: str) -> float:
        return median_of(x.groups_per_s / y.groups_per_s
                         for x, y in zip(results[a], results[b], strict=True))

    print_table(["variant", "median s", "groups/s", "MB/s (traj)"],
                [[name, median_of(r.seconds for r in rs),
                  median_of(r.groups_per_s for r in rs),
                  median_of(r.groups_per_s for r in rs) * traj_mb]
                 for name, rs in results.items()],
                title=f"{args.groups} groups per run, medians of {args.runs} runs")
    print_table(["master", "partitions", "keys", "stream MB", "used_memory MB"], rows,
                title=f"per-master distribution after {min(args.buffered, args.groups)} groups "
                      "published and scored (traj + scored streams, counters, run state)")
    print(f"cluster/node groups/s: median of per-run ratios {paired('cluster', 'node'):.3f}")
    print(f"wait1/cluster groups/s (cost of WAIT 1 on every write): median of per-run "
          f"ratios {paired('wait1', 'cluster'):.3f}")
    return 0
