"""The workers' arq health records: how many worker processes are alive, and their jobs.

Each worker process of a run writes its own record (``schemas.keys.HEALTH_KEY``) every
``HEALTH_INTERVAL_S``, with a TTL one second longer, in arq's format::

    Nov-24 05:31:02 j_complete=12 j_failed=0 j_retried=3 j_ongoing=4 queued=20

so a process that died stops counting within ~11 s. ``rollq status`` and the metrics read
them with one SCAN over the run's health keys (the control-plane Redis holds them).

A worker process still waiting for its inference servers (``rollq workers`` checks them
before it takes a job) has no arq record yet; it keeps a *waiting* record instead
(``waiting_for_inference``), so ``rollq status`` tells a pool that waits for vLLM from one
that is dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from rollq.schemas.keys import HEALTH_INTERVAL_S, HEALTH_KEY, WAITING_KEY, run_key
from rollq.schemas.tasks import beside

_FIELD = re.compile(rb"\b(j_complete|j_failed|j_retried|j_ongoing|queued)=(\d+)")
FIELDS = {"j_complete": "complete", "j_failed": "failed", "j_retried": "retried",
          "j_ongoing": "running", "queued": "queued"}


@dataclass(frozen=True)
class WorkersHealth:
    """The live workers of a run, summed over their health records."""

    alive: int
    """Worker processes whose health record has not expired."""
    running: int
    """Jobs running now (arq's ``j_ongoing``)."""
    complete: int
    """Jobs that returned, over the live workers' lifetimes (a dead-lettered job returns
    too: it is settled)."""
    failed: int
    """Jobs arq recorded as failed (rollq's job body never lets one fail: a sign of
    trouble)."""
    retried: int
    """Tries that ended in a retry."""
    queued: int
    """Jobs waiting in the run's queue, as the last record saw it."""
    waiting: int = 0
    """Worker processes alive but waiting for their inference servers (no job taken)."""


def health_pattern(run: str) -> str:
    return run_key(run, HEALTH_KEY + "*")


def parse_health(records: list[bytes | None]) -> WorkersHealth:
    """Sum arq health records (None: a key that expired between SCAN and GET)."""
    sums = dict.fromkeys(FIELDS.values(), 0)
    alive = 0
    for record in records:
        if not record:
            continue
        alive += 1
        fields = {name.decode(): int(value) for name, value in _FIELD.findall(record)}
        for name, field in FIELDS.items():
            if field == "queued":  # one queue: every record sees the same one
                sums[field] = max(sums[field], fields.get(name, 0))
            else:
                sums[field] += fields.get(name, 0)
    return WorkersHealth(alive=alive, **sums)


async def read_health(redis: Any, run: str) -> WorkersHealth:
    """The run's live workers (``redis``: an asyncio client of the control plane)."""
    keys = [key async for key in redis.scan_iter(match=health_pattern(run), count=1000)]
    health = parse_health(list(await redis.mget(keys)) if keys else [])
    waiting = [key async for key in redis.scan_iter(match=run_key(run, WAITING_KEY + "*"),
                                                    count=1000)]
    return replace(health, waiting=len(waiting))


@contextlib.asynccontextmanager
async def waiting_for_inference(redis: Any, run: str) -> AsyncIterator[None]:
    """Keep this process's waiting record while the block runs (module docstring); best
    effort: a Redis outage only hides the record."""
    key = run_key(run, WAITING_KEY + f"{socket.gethostname()}-{os.getpid()}")

    async def refresh() -> None:
        while True:
            with contextlib.suppress(Exception):  # shielded: a cancel mid-command would
                # leave its connection checked out of the pool, never closed
                await asyncio.shield(redis.set(key, b"inference", ex=HEALTH_INTERVAL_S + 1))
            await asyncio.sleep(HEALTH_INTERVAL_S)

    try:
        async with beside(refresh(), name="rollq-workers-waiting"):
            yield
    finally:
        with contextlib.suppress(Exception):
            await redis.delete(key)


def read_health_sync(redis: Any, run: str) -> WorkersHealth:
    """``read_health`` with a blocking client (the metrics exporter's thread)."""
    keys = list(redis.scan_iter(match=health_pattern(run), count=1000))
    return parse_health(list(redis.mget(keys)) if keys else [])
