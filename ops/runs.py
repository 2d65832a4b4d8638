"""A Redis' runs: list them, archive and delete finished ones (``rollq runs``, whose command
line is ``ops.cli.runs``).

A run's keys are everything under its hash tags (``rollq:{RUN}:*`` and
``rollq:{RUN:p}:*`` for each partition), arq's keys for its jobs (job ids start with
``RUN:``) and its name in ``rollq:runs``. ``delete`` removes all of them; with
``archive`` it first writes each key's ``DUMP`` (Redis' own serialisation: exact, every
type) to a file, which ``restore`` loads back with ``RESTORE``. A run that still looks
alive (a role wrote to it recently, or entries are pending) is refused unless forced, and
``--dry-run`` lists its keys all the same. ``resume`` closes a run's circuit breaker
(``schemas.breaker``), so its feeder admits jobs again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import redis.asyncio as aioredis

from rollq.consumers.bus import translated_errors
from rollq.schemas.keys import PARTITIONS_FIELD, RUNS_KEY, check_run_name, state_key, stream_keys

ARQ_PREFIXES = ("arq:job:", "arq:result:", "arq:in-progress:", "arq:retry:")
ARCHIVE_FORMAT = 1


class RunBusy(RuntimeError):
    """The run shows signs of life; deleting it would pull data from under a role."""


@dataclass(frozen=True)
class RunSummary:
    """One run, as ``rollq runs list`` shows it."""

    name: str
    partitions: int
    created_at: float | None
    last_write: float | None
    """Unix seconds of the newest stream entry of the run (None: no entries)."""
    entries: int
    """Entries in the run's traj, scored and dead streams."""
    pending: int
    """Entries delivered to some consumer and not acked."""
    bytes: int
    """Redis memory of the run's streams and hashes (``MEMORY USAGE``)."""


async def run_keys(redis: aioredis.Redis, run: str) -> list[str]:
    """Every key of ``run``: its hash-tagged keys and arq's keys of its jobs."""
    check_run_name(run)
    partitions = int(await redis.hget(state_key(run), PARTITIONS_FIELD) or 1)
    patterns = [f"rollq:{{{run}}}:*", *(f"rollq:{{{run}:{p}}}:*" for p in range(partitions)),
                *(f"{prefix}{run}:*" for prefix in ARQ_PREFIXES)]
    found: set[str] = set()
    async with translated_errors("listing a run's keys"):
        for pattern in patterns:
            async for key in redis.scan_iter(match=pattern, count=1000):
                found.add(key.decode() if isinstance(key, bytes) else key)
    return sorted(found)


async def summarise(redis: aioredis.Redis, run: str) -> RunSummary:
    async with translated_errors("reading a run"):
        state = await redis.hgetall(state_key(run))
        partitions = int(state.get(PARTITIONS_FIELD.encode(), b"1"))
        entries = pending = size = 0
        last: float | None = None
        for name in ("traj", "scored", "dead"):
            for key in stream_keys(run, partitions, name):
                if not await redis.exists(key):
                    continue
                entries += int(await redis.xlen(key))
                size += int(await redis.memory_usage(key) or 0)
                newest = await redis.xrevrange(key, count=1)
                if newest:
                    stamp = int(newest[0][0].split(b"-")[0]) / 1000
                    last = stamp if last is None else max(last, stamp)
                if name != "dead":
                    for group in await redis.xinfo_groups(key):
                        pending += int(group["pending"])
        size += int(await redis.memory_usage(state_key(run)) or 0)
    created = state.get(b"created_at")
    return RunSummary(run, partitions, float(created) if created else None, last, entries,
                      pending, size)


async def list_runs(redis: aioredis.Redis) -> list[RunSummary]:
    async with translated_errors("listing runs"):
        names = sorted(r.decode() for r in await redis.smembers(RUNS_KEY))
    return [await summarise(redis, name) for name in names]


async def check_idle(redis: aioredis.Redis, run: str, *, idle_s: float) -> None:
    """Raise ``RunBusy`` when ``run`` had a write in the last ``idle_s`` seconds or holds
    pending entries."""
    summary = await summarise(redis, run)
    if summary.pending:
        raise RunBusy(f"run {run!r} has {summary.pending} pending entries (a role holds them)")
    if summary.last_write is not None and time.time() - summary.last_write < idle_s:
        raise RunBusy(f"run {run!r} was written {time.time() - summary.last_write:.0f} s ago "
                      f"(less than {idle_s:.0f} s)")


async def archive(redis: aioredis.Redis, run: str, keys: Sequence[str], path: Path) -> int:
    """Write ``DUMP`` of every key (and its TTL) to ``path``; returns the bytes written."""
    records: list[dict[str, Any]] = []
    async with translated_errors("archiving a run"):
        for key in keys:
            dumped = await redis.dump(key)
            if dumped is None:  # gone meanwhile (an arq result expired)
                continue
            ttl = int(await redis.pttl(key))
            records.append({"key": key, "dump": dumped, "ttl_ms": max(ttl, 0)})
    document = msgpack.packb({"format": ARCHIVE_FORMAT, "run": run, "archived_at": time.time(),
                              "keys": records}, use_bin_type=True)
    await asyncio.to_thread(_write_atomically, path, document)
    return len(document)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # a crash mid-write leaves no half archive under the real name


async def delete(redis: aioredis.Redis, run: str, keys: Sequence[str]) -> int:
    """Delete the keys and the run's name; returns the number of keys removed."""
    removed = 0
    async with translated_errors("deleting a run"):
        for start in range(0, len(keys), 500):
            removed += int(await redis.unlink(*keys[start:start + 500]))
        await redis.srem(RUNS_KEY, run)
    return removed


async def restore(redis: aioredis.Redis, path: Path, *, replace: bool = False) -> tuple[str, int]:
    """Load an archive written by ``archive``; returns (run, keys restored)."""
    document = msgpack.unpackb(await asyncio.to_thread(path.read_bytes), raw=False)
    if document.get("format") != ARCHIVE_FORMAT:
        raise ValueError(f"{path} is not a rollq run archive (format {document.get('format')})")
    run = check_run_name(document["run"])
    async with translated_errors("restoring a run"):
        for record in document["keys"]:
            await redis.restore(record["key"], record["ttl_ms"], record["dump"], replace=replace)
        await redis.sadd(RUNS_KEY, run)
    return run, len(document["keys"])
