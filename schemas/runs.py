"""The run registry: a run exists once some role has registered it.

``register_run`` is the one place that writes a run's record: its name in the set of known
runs, and, first writer wins, its partition count and creation time. Every role that can
start a run first calls it (the publisher of groups, the trainer SDK, the Atropos API, the
scorer, rescore), so roles may start in any order. It lives in the leaf package because
producers and consumers both need it and may not import each other.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import redis.asyncio as aioredis

from rollq.schemas.errors import translated_errors
from rollq.schemas.keys import PARTITIONS_FIELD, RUNS_KEY, state_key


class RunRecord(NamedTuple):
    partitions: int
    """The run's partition count in force (the first registration's)."""
    created: bool
    """Whether this call created the run (no role had registered it before)."""


async def register_run(redis: aioredis.Redis, run: str, partitions: int) -> RunRecord:
    """Record ``run`` with ``partitions`` unless it exists; ``BrokerUnavailable`` when Redis
    cannot be reached."""
    async with translated_errors("registering the run"):
        pipe = redis.pipeline(transaction=False)
        pipe.sadd(RUNS_KEY, run)
        pipe.hsetnx(state_key(run), PARTITIONS_FIELD, str(partitions))
        pipe.hsetnx(state_key(run), "created_at", repr(time.time()))
        pipe.hget(state_key(run), PARTITIONS_FIELD)
        added, _, _, stored = await pipe.execute()
    return RunRecord(int(stored), bool(added))
