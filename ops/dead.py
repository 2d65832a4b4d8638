"""``rollq dead``: list, show and requeue a run's dead letters (the "retry from the dead set"
workflow of Sidekiq and Kafka DLQs).

Requeueing a letter puts its work back where it failed:

- a stream entry (a scorer's traj entry, a trainer's scored entry) is re-added to its
  source stream with its original fields, byte for byte (same ``group_id``);
- a rollout job (``source_stream`` ``jobs:<run>``) is enqueued again under its job id
  (``producers.worker.requeue_rollout``), so it publishes the same ``group_id``.

Per letter, one script on the partition's keys (they share a hash tag) deletes the letter,
adds the entry back, subtracts one from ``drop:<reason>`` (the counters keep saying what is
dead now, and the admission budget sees the group in flight again) and adds one to
``requeued``. Only the caller whose ``XDEL`` removed the letter does the rest, so a letter
requeued twice at once is requeued once. The trainer drops a copy of a group it already
trained (its seen-set, which remembers a group for the dedup window), so requeueing never
trains a group twice; a stream letter too old for that window is skipped unless forced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis

from consumers.bus import translated_errors
from producers.worker import connect_queue, requeue_rollout
from schemas import DeadLetter, DecodeError, ScoredGroup, decode, decode_dead
from schemas.keys import (
    DROP_PREFIX,
    PARTITIONS_FIELD,
    check_run_name,
    counters_key,
    state_key,
    stream_keys,
)

# KEYS[1] dead stream, KEYS[2] counters, KEYS[3] source stream ('' for a rollout job);
# ARGV[1] letter id, ARGV[2] drop counter field, ARGV[3..] the payload's field/value pairs.
_REQUEUE = """
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then return false end
redis.call('HINCRBY', KEYS[2], ARGV[2], -1)
redis.call('HINCRBY', KEYS[2], 'requeued', 1)
if #ARGV > 2 then
  local fields = {}
  for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
  return redis.call('XADD', KEYS[3], '*', unpack(fields))
end
return 'job'
"""
_JOB_SOURCE = "jobs:"


@dataclass(frozen=True)
class Letter:
    """One dead letter and where it lies."""

    stream: str
    entry_id: str
    letter: DeadLetter

    @property
    def group_id(self) -> str:
        raw = self.letter.payload.get(b"group_id")
        return raw.decode(errors="replace") if raw else self.letter.source_id

    @property
    def is_job(self) -> bool:
        return self.letter.source_stream.startswith(_JOB_SOURCE)


def parse_time(value: str, now: float | None = None) -> float:
    """Unix seconds from ``30s``/``15m``/``2h``/``3d`` ago, or an ISO 8601 time."""
    now = time.time() if now is None else now
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", value.strip())
    if match:
        amount, unit = float(match[1]), match[2]
        return now - amount * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise ValueError(f"{value!r} is neither an age like 30m/2h/1d nor an ISO time") from None


async def letters(redis: aioredis.Redis, run: str, *, reason: str | None = None,
                  since: float | None = None, until: float | None = None,
                  limit: int | None = None, newest_first: bool = True) -> list[Letter]:
    """The run's dead letters matching the filters (time by the entry's id)."""
    low = f"{int(since * 1000)}-0" if since is not None else "-"
    high = f"{int(until * 1000)}-18446744073709551615" if until is not None else "+"
    found: list[Letter] = []
    async with translated_errors("reading dead letters"):
        partitions = int(await redis.hget(state_key(run), PARTITIONS_FIELD) or 1)
        for stream in stream_keys(run, partitions, "dead"):
            for entry_id, fields in await redis.xrange(stream, min=low, max=high):
                try:
                    letter = decode_dead(fields)
                except DecodeError:
                    continue  # not a letter this code can read; `rollq tail dead` shows it
                if reason is None or letter.reason == reason:
                    found.append(Letter(stream, entry_id.decode(), letter))
    found.sort(key=lambda x: _id_key(x.entry_id), reverse=newest_first)
    return found[:limit] if limit is not None else found


async def find(redis: aioredis.Redis, run: str, entry_id: str) -> Letter | None:
    for letter in await letters(redis, run):
        if letter.entry_id == entry_id:
            return letter
    return None


PUBLISH_WINDOW_S = 3600.0
"""Every copy of a group is published within this of the others (re-runs of its job)."""


def too_old(item: Letter, dedup_window_s: float, now: float | None = None) -> bool:
    """Whether a stream entry's copy may outlive the trainer's memory of the group: past
    ``dedup_window_s − PUBLISH_WINDOW_S`` after it was published, a requeued copy of a
    group that was trained could be trained again (``consumers.trainer.ledger``)."""
    if item.is_job:
        return False  # a dead-lettered job never published its group
    published_ms = int(item.letter.source_id.partition("-")[0] or 0)
    age = (time.time() if now is None else now) - published_ms / 1000
    return age > dedup_window_s - PUBLISH_WINDOW_S


async def requeue(redis: aioredis.Redis, redis_url: str, run: str,
                  chosen: Sequence[Letter],
                  options: Mapping[str, Any] | None = None, *,
                  dedup_window_s: float | None = 6 * 3600.0) -> list[tuple[Letter, str]]:
    """Requeue letters; returns (letter, what happened) for each (``options``: the TLS
    options of ``ops.connections.redis_options``, for the arq queue). Stream letters too
    old for the trainer's dedup window (``too_old``) are skipped unless
    ``dedup_window_s`` is None (``--force``)."""
    script = redis.register_script(_REQUEUE)
    results: list[tuple[Letter, str]] = []
    queue = None
    try:
        for item in chosen:
            if item.letter.consumer_group == "rescore":
                results.append((item, "skipped: a rescore failure; run `rollq rescore` again"))
                continue
            if dedup_window_s is not None and too_old(item, dedup_window_s):
                results.append((item, "skipped: published longer ago than the trainer's "
                                "dedup window allows (a copy of a trained group could be "
                                "trained twice); --force requeues it anyway"))
                continue
            counters = counters_key(run, _partition(item.stream))
            drop = DROP_PREFIX + item.letter.reason
            if item.is_job:
                if queue is None:
                    queue = await connect_queue(redis_url, options)
                run_name, env, position = _job_parts(item.letter.source_id)
                if run_name != run:
                    results.append((item, f"skipped: the job belongs to run {run_name!r}"))
                    continue
                enqueued = await requeue_rollout(queue, run, env, position)
                async with translated_errors("requeueing"):
                    done = await script(keys=[item.stream, counters, ""],
                                        args=[item.entry_id, drop])
                results.append((item, "job enqueued" if done and enqueued else
                                "job already queued" if done else "gone (requeued meanwhile)"))
                continue
            pairs = [part for name, value in item.letter.payload.items()
                     for part in (name, value)]
            async with translated_errors("requeueing"):
                new_id = await script(keys=[item.stream, counters, item.letter.source_stream],
                                      args=[item.entry_id, drop, *pairs])
            results.append((item, f"re-added to {item.letter.source_stream} as "
                            f"{new_id.decode()}" if new_id else "gone (requeued meanwhile)"))
    finally:
        if queue is not None:
            await queue.aclose()
    return results


def _partition(dead_stream: str) -> int:
    # rollq:{<run>:<p>}:dead
    return int(dead_stream.rsplit("}", 1)[0].rsplit(":", 1)[1])


def _job_parts(source_id: str) -> tuple[str, str, int]:
    run, env, position = source_id.rsplit(":", 2)
    return run, env, int(position)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


# -- the command line ------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ops.cli import add_common_flags

    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = sub.add_parser("list", help="the run's dead letters, newest first")
    show = sub.add_parser("show", help="one dead letter in full")
    show.add_argument("id", help="the letter's entry id (from `rollq dead list`)")
    again = sub.add_parser("requeue", help="send dead letters back to where they failed")
    again.add_argument("ids", nargs="*", metavar="ID", help="letters to requeue (or filter)")
    for action in (listing, again):
        action.add_argument("--reason", help="only letters with this reason")
        action.add_argument("--since", help="only letters newer than this (30m, 2h, 1d, or "
                            "an ISO time)")
        action.add_argument("--until", help="only letters older than this")
    listing.add_argument("--limit", type=int, default=50, help="letters shown [50]")
    listing.add_argument("--oldest-first", action="store_true")
    again.add_argument("--all", action="store_true",
                       help="requeue every letter matching the filters (no IDs needed)")
    again.add_argument("--dry-run", action="store_true", help="say what would be requeued")
    again.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    again.add_argument("--dedup-window-s", type=float, default=6 * 3600.0,
                       help="the trainers' dedup_window_s: stream letters published longer "
                       "ago than it minus an hour are skipped [21600]")
    again.add_argument("--force", action="store_true",
                       help="requeue letters older than the dedup window too")
    for action in (listing, show):
        action.add_argument("--json", action="store_true", help="print JSON")
    for action in (listing, show, again):
        add_common_flags(action)


async def command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from ops.cli import Exit, redis_client, settings_for
    from ops.settings import CommonSettings
    from ops.status import known_runs

    settings: CommonSettings = settings_for(CommonSettings, args, environ)
    check_run_name(settings.run)
    redis = redis_client(settings)
    try:
        runs = await known_runs(redis)
        if settings.run not in runs:
            print(f"rollq: run {settings.run!r} not found (known runs: "
                  f"{', '.join(runs) or 'none yet'}); pass --run or ROLLQ_RUN", file=sys.stderr)
            return int(Exit.NOT_FOUND)
        if args.action == "show":
            item = await find(redis, settings.run, args.id)
            if item is None:
                print(f"rollq: no dead letter {args.id!r} in run {settings.run!r}",
                      file=sys.stderr)
                return int(Exit.NOT_FOUND)
            print(json.dumps(_document(item, full=True)) if args.json else render_one(item))
            return int(Exit.OK)
        try:
            since = parse_time(args.since) if args.since else None
            until = parse_time(args.until) if args.until else None
        except ValueError as exc:
            print(f"rollq: {exc}", file=sys.stderr)
            return int(Exit.USAGE)
        if args.action == "list":
            found = await letters(redis, settings.run, reason=args.reason, since=since,
                                  until=until, limit=args.limit,
                                  newest_first=not args.oldest_first)
            if args.json:
                print(json.dumps([_document(item) for item in found]))
            else:
                print(render_list(found))
            return int(Exit.OK)
        return await _requeue(redis, settings, args, since, until, Exit)
    finally:
        await redis.aclose()


async def _requeue(redis: aioredis.Redis, settings: Any, args: argparse.Namespace,
                   since: float | None, until: float | None, exit_codes: Any) -> int:
    from ops.connections import redis_options

    run = settings.run
    if not args.ids and not args.all:
        print("rollq: name the letters to requeue (IDs) or pass --all with filters",
              file=sys.stderr)
        return int(exit_codes.USAGE)
    found = await letters(redis, run, reason=args.reason, since=since, until=until,
                          newest_first=False)
    if args.ids:
        wanted = set(args.ids)
        found = [item for item in found if item.entry_id in wanted]
        missing = wanted - {item.entry_id for item in found}
        if missing:
            print(f"rollq: no dead letter {', '.join(sorted(missing))} in run {run!r}",
                  file=sys.stderr)
            return int(exit_codes.NOT_FOUND)
    print(f"{len(found)} dead letter(s) to requeue")
    if args.dry_run or not found:
        for item in found:
            print(f"  {_line(item)}")
        return int(exit_codes.OK)
    if not args.yes:
        if not sys.stdin.isatty():
            print("rollq: refusing to requeue without confirmation: pass --yes (stdin is not "
                  "a terminal)", file=sys.stderr)
            return int(exit_codes.USAGE)
        answer = await asyncio.to_thread(input, f"requeue {len(found)} letter(s)? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing requeued")
            return int(exit_codes.OK)
    window = None if args.force else args.dedup_window_s
    for item, outcome in await requeue(redis, settings.redis_url, run, found,
                                       redis_options(settings), dedup_window_s=window):
        print(f"{item.entry_id} {item.letter.reason} {item.group_id}: {outcome}")
    return int(exit_codes.OK)


def _document(item: Letter, *, full: bool = False) -> dict[str, Any]:
    letter = item.letter
    document: dict[str, Any] = {
        "id": item.entry_id, "stream": item.stream, "reason": letter.reason,
        "detail": letter.detail, "group_id": item.group_id,
        "source_stream": letter.source_stream, "source_id": letter.source_id,
        "consumer_group": letter.consumer_group, "deliveries": letter.deliveries,
        "dead_at": letter.dead_at,
    }
    if full:
        document["payload"] = {name.decode(errors="replace"): len(value)
                               for name, value in letter.payload.items()}
        document["payload_decoded"] = _summary(letter.payload)
    return document


def _summary(payload: Mapping[bytes, bytes]) -> str:
    if not payload:
        return "(no payload: a rollout job)"
    try:
        message = decode(payload)
    except DecodeError as exc:
        return f"does not decode: {exc}"
    group = message.trajectory if isinstance(message, ScoredGroup) else message
    return (f"{message.kind} group {group.group_id}: {len(group.completions)} completions, "
            f"{group.num_tokens} tokens, policy_version {group.policy_version}")


def _line(item: Letter, now: float | None = None) -> str:
    age = (time.time() if now is None else now) - item.letter.dead_at
    detail = item.letter.detail.replace("\n", " ")
    detail = detail if len(detail) <= 80 else detail[:77] + "..."
    return (f"{item.entry_id:<17} {_ago(age):>8} {item.letter.reason:<22} {item.group_id:<28} "
            f"{item.letter.consumer_group:<8} {detail}")


def render_list(found: Sequence[Letter]) -> str:
    if not found:
        return "no dead letters"
    header = f"{'id':<17} {'age':>8} {'reason':<22} {'group_id':<28} {'by':<8} detail"
    return "\n".join([header, *(_line(item) for item in found)])


def render_one(item: Letter) -> str:
    document = _document(item, full=True)
    sizes = document.pop("payload")
    lines = [f"{name:<15} {value}" for name, value in document.items()
             if name != "payload_decoded"]
    lines.append(f"{'dead_at (UTC)':<15} "
                 f"{datetime.fromtimestamp(item.letter.dead_at, UTC).isoformat()}")
    lines.append(f"{'payload':<15} {document['payload_decoded']}")
    lines += [f"  {name:<20} {size} bytes" for name, size in sizes.items()]
    return "\n".join(lines)


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"
