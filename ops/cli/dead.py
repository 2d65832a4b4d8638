"""``rollq dead list | show | requeue``: the command line of ``ops.dead``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis

from rollq.ops.cli.common import (
    ONE_SHOT,
    Exit,
    add_settings_flags,
    not_found,
    redis_client,
    settings_for,
)
from rollq.ops.dead import (
    DEDUP_WINDOW_S,
    Letter,
    Outcome,
    find,
    letter_in_full,
    letters,
    parse_time,
    partitions,
    requeue,
)
from rollq.ops.settings import CommonSettings
from rollq.schemas.keys import check_run_name
from rollq.schemas.runs import known_runs

_CONFIRM_SHOWN = 10
_DETAIL_WIDTH = 70


class _Refused(Exception):
    """A usage or lookup problem: the message and the exit code to end with."""

    def __init__(self, message: str, code: Exit) -> None:
        super().__init__(message)
        self.code = code


def dead_flags(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Dead letters are groups and jobs that failed for good (see "
        "docs/reference/failures.md), kept "
        "with their reason and original payload in rollq:{RUN:P}:dead. List them, show one, "
        "or requeue them once the cause is fixed: a failed scoring or trainer entry goes back "
        "to its stream byte for byte, a failed rollout job is enqueued again. The group_id "
        "is kept, so the trainer still trains each group at most once.")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = sub.add_parser(
        "list", help="the run's dead letters, newest first",
        description="One line per letter: id, partition, age, reason, group_id, source "
        "(traj, scored or job) and the detail, cut to one line.")
    show = sub.add_parser(
        "show", help="one dead letter in full",
        description="Every field of one letter; its payload decoded as a group summary when "
        "it decodes, else why not and its raw fields with their sizes.")
    show.add_argument("id", help="the letter's entry id, from `rollq dead list`")
    again = sub.add_parser(
        "requeue", help="send dead letters back to where they failed",
        description="Requeue letters by id, or --all that match the filters. A scorer's or "
        "trainer's letter is re-added to its traj or scored stream, a rollout job is enqueued "
        "again; drop:<reason> goes down and 'requeued' up by one each, so the admission "
        "budget counts the group in flight again. Asks for confirmation unless --yes.")
    again.add_argument("ids", nargs="*", metavar="ID", help="the letters to requeue")
    for action in (listing, again):
        action.add_argument("--reason", help="only letters with this reason (e.g. "
                            "reward_error; see docs/reference/failures.md)")
        action.add_argument("--since", metavar="TIME", help="only letters dead-lettered "
                            "after TIME: an age (30s, 15m, 2h, 1d) or an ISO time (UTC "
                            "unless it names a zone)")
        action.add_argument("--until", metavar="TIME", help="only letters dead-lettered "
                            "before TIME (same forms as --since)")
    for action in (listing, show, again):
        action.add_argument("--partition", type=int, metavar="P",
                            help="only this partition's dead stream (default: all)")
    listing.add_argument("--limit", type=int, default=50, help="letters shown [50]")
    listing.add_argument("--oldest-first", action="store_true", help="oldest letters first")
    again.add_argument("--all", action="store_true",
                       help="requeue every letter matching the filters (instead of IDs)")
    again.add_argument("--dry-run", action="store_true",
                       help="say what would be requeued or skipped, and change nothing")
    again.add_argument("--yes", action="store_true",
                       help="do not ask for confirmation (needed when stdin is not a terminal)")
    again.add_argument("--dedup-window-s", type=float, default=DEDUP_WINDOW_S, metavar="S",
                       help="the trainers' dedup_window_s: a stream letter whose group was "
                       "first published longer ago than S minus an hour is skipped, since "
                       f"the trainers may have forgotten they trained it [{DEDUP_WINDOW_S:.0f}]")
    again.add_argument("--force", action="store_true",
                       help="requeue letters older than the dedup window too")
    for action in (listing, show, again):
        action.add_argument("--json", action="store_true", help="print JSON")
        add_settings_flags(action, CommonSettings, skip=ONE_SHOT)


async def dead(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    settings: CommonSettings = settings_for(CommonSettings, args, environ)
    check_run_name(settings.run)
    redis = redis_client(settings)
    try:
        runs = await known_runs(redis)
        if settings.run not in runs:
            return not_found(settings.run, runs)
        count = await partitions(redis, settings.run)
        if args.partition is not None and not 0 <= args.partition < count:
            raise _Refused(f"run {settings.run!r} has partitions 0..{count - 1}, not "
                           f"{args.partition}", Exit.USAGE)
        if args.action == "show":
            [item] = await _lookup(redis, settings.run, [args.id], args.partition)
            document = await letter_in_full(redis, item)
            print(json.dumps(document) if args.json else render_one(document))
            return int(Exit.OK)
        if args.action == "list":
            since, until = _window(args)
            found = await letters(redis, settings.run, reason=args.reason, since=since,
                                  until=until, partition=args.partition, limit=args.limit,
                                  newest_first=not args.oldest_first)
            print(json.dumps([_brief(item) for item in found]) if args.json
                  else render_list(found))
            return int(Exit.OK)
        return await _requeue(redis, settings, args)
    except _Refused as refused:
        print(f"rollq: {refused}", file=sys.stderr)
        return int(refused.code)
    finally:
        await redis.aclose()


async def _requeue(redis: aioredis.Redis, settings: CommonSettings,
                   args: argparse.Namespace) -> int:
    run = settings.run
    filtered = args.reason or args.since or args.until
    if args.ids and (args.all or filtered):
        raise _Refused("pass letter IDs, or --all with filters, not both", Exit.USAGE)
    if not args.ids and not args.all:
        raise _Refused("name the letters to requeue (IDs from `rollq dead list`), or pass "
                       "--all (with --reason/--since/--until/--partition to narrow it)",
                       Exit.USAGE)
    if args.ids:
        chosen = await _lookup(redis, run, list(dict.fromkeys(args.ids)), args.partition)
    else:
        since, until = _window(args)
        chosen = await letters(redis, run, reason=args.reason, since=since, until=until,
                               partition=args.partition, newest_first=False)
    window = None if args.force else args.dedup_window_s
    if not chosen or args.dry_run:
        outcomes = await requeue(redis, run, chosen, dedup_window_s=window, dry_run=True)
        _print_outcomes(outcomes, args.json, "dry run, nothing changed: " if chosen else "")
        return int(Exit.OK)
    if not args.yes:
        if not sys.stdin.isatty():
            raise _Refused("refusing to requeue without confirmation: stdin is not a "
                           "terminal; pass --yes (or --dry-run to look first)", Exit.USAGE)
        print(render_list(chosen[:_CONFIRM_SHOWN]))
        if len(chosen) > _CONFIRM_SHOWN:
            print(f"... and {len(chosen) - _CONFIRM_SHOWN} more")
        answer = await asyncio.to_thread(input, f"requeue {len(chosen)} letter(s)? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing requeued")
            return int(Exit.OK)
    outcomes = await requeue(redis, run, chosen, dedup_window_s=window)
    _print_outcomes(outcomes, args.json)
    if not args.json and any(o.action == "requeued" and o.letter.is_job for o in outcomes):
        print("requeued rollout jobs wait for admission: the run's feeder (`rollq feed`) "
              "enqueues them within its budget, ahead of new items; start it again if it "
              "has finished")
    return int(Exit.OK)


async def _lookup(redis: aioredis.Redis, run: str, ids: Sequence[str],
                  partition: int | None) -> list[Letter]:
    """The letter of each id, or ``_Refused`` naming the ids that are malformed, missing
    or (in several partitions) ambiguous."""
    found: list[Letter] = []
    missing: list[str] = []
    for entry_id in ids:
        try:
            matches = await find(redis, run, entry_id, partition)
        except ValueError as exc:
            raise _Refused(str(exc), Exit.USAGE) from None
        if len(matches) > 1:
            raise _Refused(f"{entry_id} is a letter in partitions "
                           f"{', '.join(str(m.partition) for m in matches)}: pass --partition",
                           Exit.USAGE)
        if not matches:
            missing.append(entry_id)
        found += matches
    if missing:
        where = f"partition {partition} of " if partition is not None else ""
        raise _Refused(f"no dead letter {', '.join(missing)} in {where}run {run!r} (see "
                       "`rollq dead list`)", Exit.NOT_FOUND)
    return found


def _window(args: argparse.Namespace) -> tuple[float | None, float | None]:
    """``--since`` and ``--until`` in Unix seconds."""
    try:
        return (parse_time(args.since) if args.since else None,
                parse_time(args.until) if args.until else None)
    except ValueError as exc:
        raise _Refused(str(exc), Exit.USAGE) from None


def _print_outcomes(outcomes: Sequence[Outcome], as_json: bool, prefix: str = "") -> None:
    if as_json:
        print(json.dumps([_brief(o.letter) | {"action": o.action, "outcome": o.detail}
                          for o in outcomes]))
        return
    for outcome in outcomes:
        item = outcome.letter
        print(f"{item.entry_id} p{item.partition} {item.letter.reason} {item.group_id}: "
              f"{outcome.action}: {outcome.detail}")
    tally: dict[str, int] = {}
    for outcome in outcomes:
        tally[outcome.action] = tally.get(outcome.action, 0) + 1
    print(prefix + (", ".join(f"{n} {action.replace('_', ' ')}" for action, n in tally.items())
                    or "no dead letters match"))


def _brief(item: Letter) -> dict[str, Any]:
    letter = item.letter
    return {"id": item.entry_id, "partition": item.partition, "reason": letter.reason,
            "group_id": item.group_id, "source": item.source,
            "source_stream": letter.source_stream, "source_id": letter.source_id,
            "consumer_group": letter.consumer_group, "deliveries": letter.deliveries,
            "dead_at": letter.dead_at, "detail": letter.detail}


def render_list(found: Sequence[Letter], now: float | None = None) -> str:
    if not found:
        return "no dead letters"
    now = time.time() if now is None else now
    lines = [f"{'id':<16} {'p':>2} {'age':>6} {'reason':<22} {'group_id':<26} {'source':<6} "
             "detail"]
    for item in found:
        detail = " ".join(item.letter.detail.split())
        if len(detail) > _DETAIL_WIDTH:
            detail = detail[:_DETAIL_WIDTH - 3] + "..."
        lines.append(f"{item.entry_id:<16} {item.partition:>2} "
                     f"{_ago(now - item.letter.dead_at):>6} {item.letter.reason:<22} "
                     f"{item.group_id:<26} {item.source:<6} {detail}")
    return "\n".join(lines)


def render_one(document: Mapping[str, Any], now: float | None = None) -> str:
    """``ops.dead.letter_in_full``'s document for a terminal."""
    now = time.time() if now is None else now
    dead_at = datetime.fromtimestamp(document["dead_at"], UTC).isoformat(timespec="seconds")
    detail = str(document["detail"]).replace("\n", "\n" + " " * 16)
    lines = [
        f"{'id':<15} {document['id']} (partition {document['partition']}, "
        f"{document['stream']})",
        f"{'reason':<15} {document['reason']}",
        f"{'detail':<15} {detail or '-'}",
        f"{'group_id':<15} {document['group_id']}",
        f"{'source':<15} {document['source_stream']} {document['source_id']}",
        f"{'consumer_group':<15} {document['consumer_group']}",
        f"{'deliveries':<15} {document['deliveries']}",
        f"{'dead_at':<15} {dead_at} ({_ago(now - document['dead_at'])} ago)",
    ]
    payload = document["payload"]
    decoded = payload["decoded"]
    if decoded is not None:
        lines.append(f"{'payload':<15} {decoded['kind']} group {decoded['group_id']}: env "
                     f"{decoded['env']}, policy_version {decoded['policy_version']}, "
                     f"{decoded['completions']} completions, {decoded['prompt_tokens']} prompt "
                     f"+ {decoded['completion_tokens']} completion tokens, finish "
                     f"{_counted(decoded['finish_reasons'])}")
        if "rewards" in decoded:
            rewards = ", ".join(f"{r:.3g}" for r in decoded["rewards"])
            lines.append(f"{'':<15} rewards [{rewards}] (reward config "
                         f"{decoded['reward_config'] or '-'})")
        if payload["joined_traj_entry"]:
            lines.append(f"{'':<15} trajectory from traj entry {payload['joined_traj_entry']}")
    else:
        lines.append(f"{'payload':<15} {payload['error']}")
    fields = payload["fields"]
    if fields:
        lines.append(f"{'payload fields':<15} {sum(fields.values())} bytes in {len(fields)} fields")
        lines += [f"  {name:<20} {size:>10} bytes" for name, size in fields.items()]
    return "\n".join(lines)


def _counted(values: Sequence[str]) -> str:
    tally: dict[str, int] = {}
    for value in values:
        tally[value] = tally.get(value, 0) + 1
    return ", ".join(f"{value} ×{n}" for value, n in tally.items())


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{max(seconds, 0):.0f}s"


COMMANDS = {"dead": ("list, show and requeue a run's dead letters", dead_flags, dead)}
