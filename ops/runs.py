"""``rollq runs``: list the runs a Redis holds, archive and delete finished ones.

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

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgpack
import redis.asyncio as aioredis

from consumers.bus import translated_errors
from schemas import breaker
from schemas.keys import PARTITIONS_FIELD, RUNS_KEY, check_run_name, state_key, stream_keys

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


# -- the command line ------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ops.invocation import add_common_flags

    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = sub.add_parser("list", help="every run: partitions, entries, pending, memory, "
                             "last write")
    listing.add_argument("--json", action="store_true", help="print one JSON document")
    remove = sub.add_parser("delete", help="delete a finished run's keys (arq's included)")
    remove.add_argument("name", help="the run to delete")
    remove.add_argument("--dry-run", action="store_true", help="list what would go, delete "
                        "nothing")
    remove.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    remove.add_argument("--archive", type=Path, metavar="FILE",
                        help="first write every key (Redis DUMP) to FILE; `rollq runs "
                        "restore FILE` brings the run back")
    remove.add_argument("--idle-s", type=float, default=600.0,
                        help="refuse a run written in the last IDLE_S seconds or with "
                        "pending entries [600]")
    remove.add_argument("--force", action="store_true", help="delete even a run that looks "
                        "alive")
    back = sub.add_parser("restore", help="load a run archived by `delete --archive`")
    back.add_argument("file", type=Path)
    back.add_argument("--replace", action="store_true", help="overwrite keys that exist")
    again = sub.add_parser("resume", help="admit jobs again after the circuit breaker "
                           "stopped a run (consecutive jobs failed the same way): fix the "
                           "cause first")
    again.add_argument("name", help="the run to resume")
    for action in (listing, remove, back, again):
        add_common_flags(action)


async def command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from ops.invocation import Exit, redis_client, settings_for
    from ops.settings import CommonSettings

    settings: CommonSettings = settings_for(CommonSettings, args, environ)
    redis = redis_client(settings)
    try:
        if args.action == "list":
            runs = await list_runs(redis)
            if args.json:
                print(json.dumps([asdict(r) for r in runs]))
            else:
                print(render(runs))
            return Exit.OK
        if args.action == "restore":
            run, count = await restore(redis, args.file, replace=args.replace)
            print(f"restored run {run!r}: {count} keys")
            return Exit.OK
        if args.action == "resume":
            return await _resume(redis, args.name, Exit)
        return await _delete(redis, args, Exit)
    finally:
        await redis.aclose()


async def _delete(redis: aioredis.Redis, args: argparse.Namespace, exit_codes: Any) -> int:
    run = check_run_name(args.name)
    if run not in {r.decode() for r in await redis.smembers(RUNS_KEY)}:
        print(f"rollq: run {run!r} not found (see `rollq runs list`)", file=sys.stderr)
        return int(exit_codes.NOT_FOUND)
    busy: RunBusy | None = None
    if not args.force:
        try:
            await check_idle(redis, run, idle_s=args.idle_s)
        except RunBusy as exc:
            busy = exc
            if not args.dry_run:
                print(f"rollq: {exc}; stop its roles first, or pass --force", file=sys.stderr)
                return int(exit_codes.FAILURE)
    keys = await run_keys(redis, run)
    print(f"run {run!r}: {len(keys)} keys")
    if args.dry_run:
        for key in keys:
            print(f"  {key}")
        if busy is not None:
            print(f"note: a delete would be refused now: {busy}; stop its roles first, or "
                  "pass --force")
        return int(exit_codes.OK)
    if not args.yes:
        if not sys.stdin.isatty():
            print("rollq: refusing to delete without confirmation: pass --yes (stdin is not "
                  "a terminal)", file=sys.stderr)
            return int(exit_codes.USAGE)
        answer = await asyncio.to_thread(
            input, f"delete run {run!r} and its {len(keys)} keys? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return int(exit_codes.OK)
    if args.archive is not None:
        size = await archive(redis, run, keys, args.archive)
        print(f"archived {len(keys)} keys to {args.archive} ({size / 1e6:.1f} MB)")
    print(f"deleted {await delete(redis, run, keys)} keys of run {run!r}")
    return int(exit_codes.OK)


async def _resume(redis: aioredis.Redis, name: str, exit_codes: Any) -> int:
    run = check_run_name(name)
    if run not in {r.decode() for r in await redis.smembers(RUNS_KEY)}:
        print(f"rollq: run {run!r} not found (see `rollq runs list`)", file=sys.stderr)
        return int(exit_codes.NOT_FOUND)
    was = await breaker.resume(redis, run)
    if was is None:
        print(f"run {run!r} was admitting jobs: nothing to resume")
    else:
        print(f"run {run!r} resumed: the feeder admits jobs again (it had stopped after "
              f"{was.streak} jobs failed with {was.reason})")
    return int(exit_codes.OK)


def render(runs: Sequence[RunSummary]) -> str:
    if not runs:
        return "no runs"
    now = time.time()
    lines = [f"{'run':<24} {'parts':>5} {'entries':>8} {'pending':>8} {'memory':>10} "
             f"{'last write':>12} {'created':>12}"]
    for r in runs:
        last = "-" if r.last_write is None else _ago(now - r.last_write)
        created = "-" if r.created_at is None else _ago(now - r.created_at)
        lines.append(f"{r.name:<24} {r.partitions:>5} {r.entries:>8} {r.pending:>8} "
                     f"{r.bytes / 1e6:>8.1f}MB {last:>12} {created:>12}")
    return "\n".join(lines)


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit} ago"
    return f"{seconds:.0f}s ago"
