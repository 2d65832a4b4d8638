"""``rollq status`` and ``rollq tail``: looking at a run, joining no consumer group."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog

from rollq.consumers.bus import follow
from rollq.ops.cli.common import (
    ONE_SHOT,
    Exit,
    add_settings_flags,
    not_found,
    redis_client,
    settings_for,
)
from rollq.ops.connections import is_cluster_url, open_queue_redis
from rollq.ops.lifecycle import stop_on_signals
from rollq.ops.settings import CommonSettings
from rollq.ops.status import RunNotFound, collect_status, render_status
from rollq.ops.tail import printer
from rollq.schemas.keys import STREAM_NAMES, stream_keys
from rollq.schemas.outage import OutageRider, StoppedDuringOutage
from rollq.schemas.runs import known_runs


def status_flags(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, CommonSettings, skip=ONE_SHOT)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--watch", type=float, metavar="SECONDS",
                        help="refresh every SECONDS and show rates, until Ctrl-C")


async def status(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    settings: CommonSettings = settings_for(CommonSettings, args, environ)
    redis = redis_client(settings)
    # arq's queue (jobs in flight) is on the control plane when the data is on a cluster
    queue = open_queue_redis(settings) if is_cluster_url(settings.redis_url) else None
    stop = stop_on_signals() if args.watch else asyncio.Event()
    try:
        previous = None
        # --watch rides out Redis restarts like every long-running role; one shot does not.
        rider = OutageRider(give_up_s=settings.redis_give_up_s if args.watch else 0.0,
                            what="status", log=structlog.get_logger("rollq.status"),
                            stop=stop)
        while True:
            try:
                current = await rider.call(lambda: collect_status(redis, settings.run,
                                                                  queue=queue))
            except RunNotFound:
                return not_found(settings.run, await known_runs(redis))
            except StoppedDuringOutage:
                return Exit.OK
            if args.json:
                print(json.dumps(current.as_dict(), default=str))
            else:
                print(render_status(current, previous), flush=True)
            if not args.watch:
                return Exit.OK
            previous = current
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.watch)
            if stop.is_set():
                return Exit.OK
            print()
    finally:
        await redis.aclose()
        if queue is not None:
            await queue.aclose()


def tail_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stream", choices=STREAM_NAMES, help="which stream of the run")
    add_settings_flags(parser, CommonSettings, skip=ONE_SHOT)
    parser.add_argument("--from-start", action="store_true",
                        help="print existing entries first (default: only new ones)")
    parser.add_argument("--count", type=int, help="stop after COUNT entries")
    parser.add_argument("--width", type=int, default=100, help="characters of text shown")


async def tail(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    settings: CommonSettings = settings_for(CommonSettings, args, environ)
    redis = redis_client(settings)
    try:
        runs = await known_runs(redis)
        if settings.run not in runs:
            return not_found(settings.run, runs)
        status = await collect_status(redis, settings.run)
        keys = stream_keys(settings.run, status.partitions, args.stream)
        handle: Callable[[str, str, Any], Awaitable[None]] = printer(  # type: ignore[assignment]
            lambda text: print(text, flush=True), args.width, redis)
        await follow(redis, keys, handle, start="0-0" if args.from_start else "$",
                     limit=args.count, stop=stop_on_signals())  # SIGINT/SIGTERM: exit 0
        return Exit.OK
    finally:
        await redis.aclose()


COMMANDS = {
    "status": ("show a run's streams, consumer groups, lag, pending entries and drops",
               status_flags, status),
    "tail": ("follow a stream of a run live (joins no consumer group)", tail_flags, tail),
}
