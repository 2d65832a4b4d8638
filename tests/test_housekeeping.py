"""Housekeeping: dead consumers (idle, nothing pending) are removed, live ones and ones
holding entries are kept; dead letters are trimmed by age."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from rollq.consumers.bus import StreamReader
from rollq.consumers.housekeeping import forget_idle_consumers, trim_dead

STREAM = "rollq:{hk:0}:traj"


async def test_idle_consumers_without_pending_entries_are_forgotten(
        real_redis: aioredis.Redis) -> None:
    await real_redis.xadd(STREAM, {"a": "1"})
    holder = StreamReader(real_redis, [STREAM], "scorers", "holder")
    await holder.ensure_groups()
    assert len(await holder.read(count=1, block_ms=0)) == 1  # holds an unacked entry
    for name in ("gone-1", "gone-2", "me"):  # restarted roles that left no work behind
        await real_redis.xgroup_createconsumer(STREAM, "scorers", name)
    await asyncio.sleep(0.12)
    removed = await forget_idle_consumers(real_redis, [STREAM, "rollq:{hk:1}:traj"],
                                          "scorers", 100, keep="me")
    assert removed == 2
    names = {c["name"].decode() for c in await real_redis.xinfo_consumers(STREAM, "scorers")}
    assert names == {"holder", "me"}  # its pending entry keeps it; the caller is kept
    assert await forget_idle_consumers(real_redis, [STREAM], "scorers", 60_000) == 0


async def test_dead_letters_are_trimmed_by_age(real_redis: aioredis.Redis) -> None:
    dead = "rollq:{hk:0}:dead"
    now = int(time.time() * 1000)
    await real_redis.xadd(dead, {"v": "1"}, id=f"{now - 10_000}-0")
    await real_redis.xadd(dead, {"v": "1"}, id=f"{now - 10}-0")
    assert await trim_dead(real_redis, [dead, "rollq:{hk:1}:dead"], retention_ms=5_000) == 1
    assert await real_redis.xlen(dead) == 1
