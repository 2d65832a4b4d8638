"""The whole pipeline on a Redis Cluster (3 masters + 3 replicas, partitions = 6), with a
master killed mid-run: its replica is promoted and every role carries on by itself.

Every admitted group must end trained once, dead-lettered, or (only for writes the dead
master had not yet replicated, and never with ``wait_replicas``) be reported lost by
``rollq status`` (``accounting.unaccounted``): none silently missing.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from redis.cluster import key_slot

from rollq.ops.cli import Exit, main
from rollq.ops.local.cluster import LocalCluster
from rollq.schemas.keys import stream_key
from tests.cluster.pipeline import dead_group_ids, run_pipeline
from tests.redis_server import RedisServer

ITEMS = 40


def _slot(run: str, partition: int) -> int:
    return key_slot(stream_key(run, partition, "traj").encode())


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("wait_replicas", [0, 1], ids=["async-replication", "wait"])
async def test_a_master_killed_mid_run_loses_nothing_silently(
        fresh_redis_cluster: LocalCluster, redis_server: RedisServer, tmp_path: Path,
        wait_replicas: int, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = fresh_redis_cluster
    run = f"failover-{wait_replicas}"
    victim_slot = _slot(run, 0)
    killed: list[int] = []

    async def failover() -> None:
        victim = await asyncio.to_thread(cluster.kill_master, victim_slot)
        killed.append(victim.port)
        assert cluster.master_of(victim_slot).port != victim.port  # the replica took over
        if wait_replicas:
            # the promoted master has no replica until the old one comes back (as its
            # replica): until then writes to its partitions wait, and are retried
            await asyncio.to_thread(victim.start)

    outcome = await run_pipeline(tmp_path, data_url=cluster.url, queue_url=redis_server.url,
                                 run=run, items=ITEMS, mid_run=failover, at_trained=12,
                                 wait_replicas=wait_replicas)
    assert outcome.failovers == 1 and killed
    # the failover hit the roles mid-run, and they rode it out by themselves
    assert outcome.outages, "no role saw the failover"
    assert outcome.admitted == ITEMS
    status = outcome.status
    assert status is not None and status.accounting is not None
    twice = {g for g, n in outcome.trained.items() if n > 1}
    assert not twice, f"trained more than once: {twice}"
    dead = await dead_group_ids(cluster.url, run)
    assert not dead, f"nothing here fails, yet these were dead-lettered: {dead}"
    missing = outcome.expected_ids - set(outcome.trained) - dead
    # what is missing is exactly what status reports lost; with WAIT nothing may be
    assert len(missing) == status.accounting.unaccounted, (missing, status.as_dict())
    if wait_replicas:
        assert not missing
    # the same books through the CLI, on the cluster and the control plane
    code = await asyncio.to_thread(main, ["status", "--redis-url", cluster.url, "--run", run,
                                          "--json"], {"ROLLQ_QUEUE_URL": redis_server.url})
    assert code == Exit.OK
    shown = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert shown["admitted"] == ITEMS
    assert shown["accounting"]["unaccounted"] == status.accounting.unaccounted
    print(f"outages ridden out by role: {outcome.outages}; trained {len(outcome.trained)}, "
          f"dead {len(dead)}, reported lost {status.accounting.unaccounted}")
    assert status.counters.get("consumed", 0) + sum(status.drops.values()) >= (
        ITEMS - len(missing))
