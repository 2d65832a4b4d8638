"""``rollq runs list | delete | restore | resume``: the command line of ``ops.runs``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import redis.asyncio as aioredis

from rollq.ops.cli.common import ONE_SHOT, Exit, add_settings_flags, redis_client, settings_for
from rollq.ops.runs import (
    RunBusy,
    RunSummary,
    archive,
    check_idle,
    delete,
    list_runs,
    restore,
    run_keys,
)
from rollq.ops.settings import CommonSettings
from rollq.schemas import breaker
from rollq.schemas.keys import RUNS_KEY, check_run_name


def runs_flags(parser: argparse.ArgumentParser) -> None:
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
        add_settings_flags(action, CommonSettings, skip=ONE_SHOT)


async def runs(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
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
            return await _resume(redis, args.name)
        return await _delete(redis, args)
    finally:
        await redis.aclose()


async def _missing(redis: aioredis.Redis, run: str) -> bool:
    """True, having said so, when this Redis holds no run ``run``."""
    if run in {r.decode() for r in await redis.smembers(RUNS_KEY)}:
        return False
    print(f"rollq: run {run!r} not found (see `rollq runs list`)", file=sys.stderr)
    return True


async def _delete(redis: aioredis.Redis, args: argparse.Namespace) -> int:
    run = check_run_name(args.name)
    if await _missing(redis, run):
        return int(Exit.NOT_FOUND)
    busy: RunBusy | None = None
    if not args.force:
        try:
            await check_idle(redis, run, idle_s=args.idle_s)
        except RunBusy as exc:
            busy = exc
            if not args.dry_run:
                print(f"rollq: {exc}; stop its roles first, or pass --force", file=sys.stderr)
                return int(Exit.FAILURE)
    keys = await run_keys(redis, run)
    print(f"run {run!r}: {len(keys)} keys")
    if args.dry_run:
        for key in keys:
            print(f"  {key}")
        if busy is not None:
            print(f"note: a delete would be refused now: {busy}; stop its roles first, or "
                  "pass --force")
        return int(Exit.OK)
    if not args.yes:
        if not sys.stdin.isatty():
            print("rollq: refusing to delete without confirmation: pass --yes (stdin is not "
                  "a terminal)", file=sys.stderr)
            return int(Exit.USAGE)
        answer = await asyncio.to_thread(
            input, f"delete run {run!r} and its {len(keys)} keys? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return int(Exit.OK)
    if args.archive is not None:
        size = await archive(redis, run, keys, args.archive)
        print(f"archived {len(keys)} keys to {args.archive} ({size / 1e6:.1f} MB)")
    print(f"deleted {await delete(redis, run, keys)} keys of run {run!r}")
    return int(Exit.OK)


async def _resume(redis: aioredis.Redis, name: str) -> int:
    run = check_run_name(name)
    if await _missing(redis, run):
        return int(Exit.NOT_FOUND)
    was = await breaker.resume(redis, run)
    if was is None:
        print(f"run {run!r} was admitting jobs: nothing to resume")
    else:
        why = (f"{was.streak} groups were dropped as zero-variance"
               if was.reason == breaker.ZERO_VARIANCE
               else f"{was.streak} jobs failed with {was.reason}")
        print(f"run {run!r} resumed: the feeder admits jobs again (it had stopped after "
              f"{why})")
    return int(Exit.OK)


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


COMMANDS = {"runs": ("list the runs in Redis; archive, delete or restore a finished one",
                     runs_flags, runs)}
