"""The run registry: a run exists once some role has registered it.

``register_run`` is the one place that writes a run's record: its name in the set of known
runs, and, first writer wins, its partition count and creation time. Every role that can
start a run first calls it (the publisher of groups, the trainer SDK, the Atropos API, the
scorer, rescore), so roles may start in any order. It lives in the leaf package because
producers and consumers both need it and may not import each other.

A role started on a run that has not started says so at start-up, at WARNING
(``unknown_run_message``): a typo in ``--run`` otherwise shows only as a run where nothing
ever happens. A run has *started* once some role worked on it (``run_started``), not when it
was merely registered: workers, a scorer and a trainer started with the same typo would
otherwise register it for each other, and only the first would say so.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import redis.asyncio as aioredis

from rollq.schemas.errors import translated_errors
from rollq.schemas.keys import (
    PARTITIONS_FIELD,
    RUNS_KEY,
    TRAINER_WAITING_FIELD,
    counters_key,
    state_key,
    stream_key,
)

REGISTRATION_FIELDS = frozenset({PARTITIONS_FIELD, "created_at", TRAINER_WAITING_FIELD})
"""State fields a role writes without working on the run (registering it, or a trainer
waiting for groups): any other field means a role worked on it."""


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


async def known_runs(redis: aioredis.Redis) -> list[str]:
    """The names of every registered run, sorted."""
    async with translated_errors("listing runs"):
        return sorted(r.decode() for r in await redis.smembers(RUNS_KEY))


async def run_started(redis: aioredis.Redis, run: str) -> bool:
    """Whether some role has worked on ``run``: a feeder recorded its settings or admitted
    jobs, a group was published or scored, a trainer published a policy version."""
    async with translated_errors("reading the run's state"):
        fields = {k.decode() for k in await redis.hkeys(state_key(run))}
        if fields - REGISTRATION_FIELDS:
            return True
        if not fields:
            return False
        partitions = int(await redis.hget(state_key(run), PARTITIONS_FIELD) or 1)
        for p in range(partitions):
            if await redis.exists(counters_key(run, p)) or await redis.xlen(
                    stream_key(run, p, "traj")):
                return True
    return False


def unknown_run_message(run: str, role: str, known: list[str]) -> str:
    """The start-up WARNING of a ``role`` started on ``run`` that did not exist: the known
    runs, and how a run comes to exist."""
    others = [name for name in known if name != run]
    role = "worker pool" if role == "workers" else role
    return (f"run {run!r} did not exist when this {role} started (no role had worked on it); "
            f"known runs: "
            f"{', '.join(others) or 'none'}: a typo in --run? A run comes to exist when a role "
            f"registers it (its feeder: `rollq feed --run {run}`, its trainer, a scorer, or "
            f"workers publishing its first group); this {role} goes on and waits for its work")
