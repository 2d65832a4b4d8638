"""The subcommands: their flags and the coroutine each runs."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ops.cli import Exit, redis_client, settings_for
from ops.settings import CommonSettings
from ops.status import RunNotFound, collect_status, known_runs, render_status
from ops.tail import printer
from schemas.keys import STREAM_NAMES, stream_keys


async def _run_exists(redis: Any, run: str) -> tuple[bool, list[str]]:
    runs = await known_runs(redis)
    return run in runs, runs


def _not_found(run: str, runs: list[str]) -> int:
    known = ", ".join(runs) if runs else "none yet"
    print(f"rollq: run {run!r} not found (known runs: {known}); pass --run or ROLLQ_RUN",
          file=sys.stderr)
    return Exit.NOT_FOUND


# -- status ---------------------------------------------------------------------------------

def _status_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--watch", type=float, metavar="SECONDS",
                        help="refresh every SECONDS and show rates, until Ctrl-C")


async def status(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    settings: CommonSettings = settings_for(CommonSettings, args, environ)
    redis = redis_client(settings)
    try:
        previous = None
        while True:
            try:
                current = await collect_status(redis, settings.run)
            except RunNotFound:
                return _not_found(settings.run, await known_runs(redis))
            if args.json:
                print(json.dumps(current.as_dict(), default=str))
            else:
                print(render_status(current, previous), flush=True)
            if not args.watch:
                return Exit.OK
            previous = current
            await asyncio.sleep(args.watch)
            print()
    finally:
        await redis.aclose()


# -- tail -----------------------------------------------------------------------------------

def _tail_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stream", choices=STREAM_NAMES, help="which stream of the run")
    parser.add_argument("--from-start", action="store_true",
                        help="print existing entries first (default: only new ones)")
    parser.add_argument("--count", type=int, help="stop after COUNT entries")
    parser.add_argument("--width", type=int, default=100, help="characters of text shown")


async def tail(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from consumers.bus import follow

    settings: CommonSettings = settings_for(CommonSettings, args, environ)
    redis = redis_client(settings)
    try:
        exists, runs = await _run_exists(redis, settings.run)
        if not exists:
            return _not_found(settings.run, runs)
        status = await collect_status(redis, settings.run)
        keys = stream_keys(settings.run, status.partitions, args.stream)
        handle: Callable[[str, str, Any], Awaitable[None]] = printer(  # type: ignore[assignment]
            lambda text: print(text, flush=True), args.width)
        await follow(redis, keys, handle, start="0-0" if args.from_start else "$",
                     limit=args.count)
        return Exit.OK
    finally:
        await redis.aclose()


# -- tiny-model -----------------------------------------------------------------------------

def _tiny_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where to write the model (created if missing)")
    parser.add_argument("--seed", type=int, default=0)


async def tiny_model(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from pathlib import Path

    from ops.tiny_model import write_tiny_model

    path = write_tiny_model(Path(args.directory), seed=args.seed)
    print(path)
    return Exit.OK


Command = tuple[str, Callable[[argparse.ArgumentParser], None],
                Callable[[argparse.Namespace, Mapping[str, str]], Awaitable[int]]]

COMMANDS: dict[str, Command] = {
    "status": ("show a run's streams, consumer groups, lag, pending entries and drops",
               _status_args, status),
    "tail": ("follow a stream of a run live (joins no consumer group)", _tail_args, tail),
    "tiny-model": ("write a tiny random Qwen2 model + tokenizer for local runs (needs the "
                   "'train' extra)", _tiny_model_args, tiny_model),
}
NO_COMMON_FLAGS = {"tiny-model"}
