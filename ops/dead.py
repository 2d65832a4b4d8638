"""Dead letters of a run: list, look up and requeue them (the "retry from the dead set"
workflow of Sidekiq and Kafka DLQs). The command line is ``ops.cli.dead``.

Requeueing a letter puts its work back where it failed:

- a stream entry (a scorer's traj entry, a trainer's scored entry) is re-added to its
  source stream with its original fields, byte for byte (same ``group_id``), and is
  processed again by that stream's consumer groups;
- a rollout job (``source_stream`` ``jobs:<run>``) goes to its partition's readmit list
  (``schemas.keys.readmit_key``); the run's feeder enqueues it from there under its job id
  (``producers.worker.requeue_rollout``, same ``group_id``) within the admission budget,
  ahead of new items, like a new job: a requeue of hundreds of letters never floods the
  queue with groups that would go stale before the trainer reaches them.

Accounting, per letter and atomic (the partition's keys share a hash tag): the letter is
deleted, ``drop:<reason>`` goes down by one (the counters keep saying what is dead now, and
the admission budget sees the group in flight again) and ``requeued`` up by one. For a
stream entry the copy is XADDed in the same MULTI/EXEC, and the script after it deletes the
copy again unless its own XDEL removed the letter, so of two callers requeueing one letter
exactly one re-adds it (as ``consumers.bus`` forwards: the payload, up to a whole group,
stays out of the script's arguments). A rollout job's letter is moved to the readmit list
by one script, so two callers requeue it once. While it waits there the admission budget
does not count it in flight (``producers.feeder``).

Requeueing never trains a group twice: the ``group_id`` is kept, and the trainer drops a
copy of a group it already trained (its seen-set, which remembers a group for
``dedup_window_s``). A stream letter first published longer ago than that window (minus
``PUBLISH_WINDOW_S``) is therefore skipped unless forced (``dedup_window_s=None``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import redis.asyncio as aioredis
import structlog

from rollq.consumers.bus import is_entry_id, join_trajectories, translated_errors
from rollq.consumers.trainer import TrainerClientSettings
from rollq.producers.sessions.host import SOURCE_PREFIX as SESSIONS_SOURCE_PREFIX
from rollq.schemas import (
    DeadLetter,
    DecodeError,
    Fields,
    ScoredGroup,
    decode,
    decode_dead,
    trajectory_ref,
)
from rollq.schemas.keys import (
    DROP_PREFIX,
    PARTITIONS_FIELD,
    counters_key,
    parse_job_id,
    readmit_key,
    state_key,
    stream_key,
)

log = structlog.get_logger("rollq.dead")

REQUEUED_COUNTER = "requeued"
"""Counters-hash field: letters requeued from this partition's dead stream, ever."""
RESCORE_GROUP = "rescore"
"""The ``consumer_group`` of rescore's dead letters (``ops.rescore``): run rescore again."""
JOB_SOURCE_PREFIX = "jobs:"
PUBLISH_WINDOW_S = 3600.0
"""Every copy of a group is published within this of the others (re-runs of its job)."""
DEDUP_WINDOW_S = TrainerClientSettings().dedup_window_s
"""The trainers' default ``dedup_window_s``."""

# Run inside MULTI right after the XADD of the copy (to KEYS[3], absent for a rollout job).
# KEYS[1] dead stream, KEYS[2] counters, KEYS[3] the copy's stream, KEYS[4] the traj stream
# when ARGV[4] names a traj entry (a reference-form scored copy); ARGV[1] letter id,
# ARGV[2] drop:<reason>, ARGV[3] the requeued counter, ARGV[4] traj entry id or ''.
# Returns 1 (requeued), 0 (the letter was gone: requeued by someone else) or -1 (the traj
# entry the copy names is gone: requeueing would only dead-letter it again).
_CLAIM = """
local function undo()
  if #KEYS > 2 then
    local added = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
    redis.call('XDEL', KEYS[3], added[1][1])
  end
end
if ARGV[4] ~= '' and #redis.call('XRANGE', KEYS[4], ARGV[4], ARGV[4]) == 0 then
  undo()
  return -1
end
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then
  undo()
  return 0
end
redis.call('HINCRBY', KEYS[2], ARGV[2], -1)
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
return 1
"""
# KEYS[1] dead stream, KEYS[2] counters, KEYS[3] the partition's readmit list; ARGV[1]
# letter id, ARGV[2] drop:<reason>, ARGV[3] the requeued counter, ARGV[4] the job id.
# Returns 1 (moved to the readmit list) or 0 (the letter was gone: requeued by someone else).
_READMIT = """
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[2], -1)
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
redis.call('RPUSH', KEYS[3], ARGV[4])
return 1
"""
_PAGE = 256
_TIME_AGO = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class Letter:
    """One dead letter and where it lies."""

    stream: str
    """The dead stream holding it, ``rollq:{<run>:<p>}:dead``."""
    entry_id: str
    letter: DeadLetter

    @property
    def partition(self) -> int:
        return int(self.stream.rsplit("}", 1)[0].rsplit(":", 1)[1])

    @property
    def group_id(self) -> str:
        raw = self.letter.payload.get(b"group_id")
        return raw.decode(errors="replace") if raw else self.letter.source_id

    @property
    def is_job(self) -> bool:
        return self.letter.source_stream.startswith(JOB_SOURCE_PREFIX)

    @property
    def source(self) -> str:
        """``job``, ``traj`` or ``scored`` (the stream's last part), for one-line listings."""
        return "job" if self.is_job else self.letter.source_stream.rsplit(":", 1)[-1]


@dataclass(frozen=True)
class Outcome:
    """What ``requeue`` did with one letter."""

    letter: Letter
    action: Literal["requeued", "gone", "skipped", "would_requeue"]
    """``gone``: someone else requeued (or deleted) it meanwhile; ``would_requeue``: a dry
    run's answer."""
    detail: str


def parse_time(value: str, now: float | None = None) -> float:
    """Unix seconds from an age (``30s``, ``15m``, ``2h``, ``3d`` ago) or an ISO 8601 time
    (UTC when it names no zone). Raises ValueError for anything else."""
    now = time.time() if now is None else now
    match = _TIME_AGO.fullmatch(value.strip())
    if match:
        return now - float(match[1]) * _UNITS[match[2]]
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(f"{value!r} is neither an age like 30m, 2h, 1d nor an ISO time like "
                         "2026-01-31T12:00") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


async def partitions(redis: aioredis.Redis, run: str) -> int:
    async with translated_errors("reading run state"):
        return int(await redis.hget(state_key(run), PARTITIONS_FIELD) or 1)


async def letters(redis: aioredis.Redis, run: str, *, reason: str | None = None,
                  since: float | None = None, until: float | None = None,
                  partition: int | None = None, limit: int | None = None,
                  newest_first: bool = True) -> list[Letter]:
    """The run's dead letters matching the filters, newest (or oldest) first; time is the
    letter's entry id (when it was dead-lettered), in Unix seconds. Reads at most ``limit``
    matches per partition, a page at a time. A dead-stream entry that is not a letter this
    code reads is left out and logged (``rollq tail dead`` shows it raw)."""
    low = f"{int(since * 1000)}-0" if since is not None else "-"
    high = f"{int(until * 1000)}-18446744073709551615" if until is not None else "+"
    count = await partitions(redis, run)
    chosen = range(count) if partition is None else [partition] if partition < count else []
    found: list[Letter] = []
    for p in chosen:
        stream = stream_key(run, p, "dead")
        matched = 0
        start, end = (high, low) if newest_first else (low, high)
        while limit is None or matched < limit:
            async with translated_errors("reading dead letters"):
                if newest_first:
                    page = await redis.xrevrange(stream, max=start, min=end, count=_PAGE)
                else:
                    page = await redis.xrange(stream, min=start, max=end, count=_PAGE)
            for raw_id, fields in page:
                item = _letter(stream, raw_id.decode(), fields)
                if item is not None and (reason is None or item.letter.reason == reason):
                    found.append(item)
                    matched += 1
                    if limit is not None and matched >= limit:
                        break
            if len(page) < _PAGE:
                break
            start = "(" + page[-1][0].decode()
    found.sort(key=lambda item: _id_key(item.entry_id), reverse=newest_first)
    return found[:limit] if limit is not None else found


async def find(redis: aioredis.Redis, run: str, entry_id: str,
               partition: int | None = None) -> list[Letter]:
    """The letters with this entry id: one, or none, or (with several partitions and no
    ``partition``, since each dead stream numbers its own entries) more than one."""
    if not is_entry_id(entry_id):
        raise ValueError(f"{entry_id!r} is not a stream entry id like 1767225600000-0")
    count = await partitions(redis, run)
    chosen = range(count) if partition is None else [partition] if partition < count else []
    found: list[Letter] = []
    for p in chosen:
        stream = stream_key(run, p, "dead")
        async with translated_errors("reading a dead letter"):
            entries = await redis.xrange(stream, min=entry_id, max=entry_id)
        for raw_id, fields in entries:
            item = _letter(stream, raw_id.decode(), fields)
            if item is not None:
                found.append(item)
    return found


def published_at(item: Letter) -> float | None:
    """When the group of a stream letter was first published, in Unix seconds, as far as
    the letter tells (None for a rollout job, which never published): the oldest of its
    source entry's id, the traj entry a reference-form scored entry names, and the group's
    ``finished_at``. The source id alone is too young for a letter requeued before."""
    if item.is_job:
        return None
    candidates = [_id_seconds(item.letter.source_id)]
    payload = item.letter.payload
    ref = trajectory_ref(payload)
    if ref is not None:
        candidates.append(_id_seconds(ref))
    else:
        try:
            message = decode(payload)
        except DecodeError:
            pass
        else:
            group = message.trajectory if isinstance(message, ScoredGroup) else message
            candidates.append(group.finished_at)
    known = [moment for moment in candidates if moment is not None and moment > 0]
    return min(known) if known else None


def too_old(item: Letter, dedup_window_s: float, now: float | None = None) -> bool:
    """Whether a requeued copy of this letter's group could outlive the trainers' memory of
    it: first published more than ``dedup_window_s − PUBLISH_WINDOW_S`` ago (see
    ``consumers.trainer.ledger``). Rollout jobs never are: they never published."""
    published = published_at(item)
    if published is None:
        return False
    return (time.time() if now is None else now) - published > dedup_window_s - PUBLISH_WINDOW_S


def refusal(item: Letter, run: str, dedup_window_s: float | None) -> str | None:
    """Why a letter must not be requeued (None: it may)."""
    letter = item.letter
    if letter.consumer_group == RESCORE_GROUP:
        return "a rescore failure: run `rollq rescore` again"
    if letter.source_stream.startswith(SESSIONS_SOURCE_PREFIX):
        return ("an external session group (rollq gateway --sessions): its agent opens a new "
                "group")
    if item.is_job:
        if letter.source_stream != JOB_SOURCE_PREFIX + run or parse_job_id(run, letter.source_id) \
                is None:
            return (f"job {letter.source_id!r} of {letter.source_stream!r} is not a rollout "
                    f"job of run {run!r}")
        return None
    own = {stream_key(run, item.partition, name) for name in ("traj", "scored")}
    if letter.source_stream not in own:
        return (f"source {letter.source_stream!r} is not this partition's traj or scored "
                "stream")
    if not letter.payload:
        return "the letter kept no payload to re-add"
    if dedup_window_s is not None and too_old(item, dedup_window_s):
        return ("first published longer ago than the trainers' dedup window allows (a copy of "
                "a trained group could be trained twice); force to requeue it anyway")
    return None


async def requeue(redis: aioredis.Redis, run: str, chosen: Sequence[Letter], *,
                  dedup_window_s: float | None = DEDUP_WINDOW_S,
                  dry_run: bool = False) -> list[Outcome]:
    """Requeue letters, in order; one ``Outcome`` each.
    ``dedup_window_s``: the trainers' setting (``too_old``); None requeues old letters too.
    ``dry_run``: say what would happen, change nothing."""
    outcomes: list[Outcome] = []
    for item in chosen:
        why = refusal(item, run, dedup_window_s)
        if why is not None:
            outcomes.append(Outcome(item, "skipped", why))
        elif dry_run:
            target = f"job {item.letter.source_id}" if item.is_job else \
                item.letter.source_stream
            outcomes.append(Outcome(item, "would_requeue", f"would go back to {target}"))
        elif item.is_job:
            outcomes.append(await _requeue_job(redis, run, item))
        else:
            outcomes.append(await _requeue_entry(redis, run, item))
    return outcomes


async def _requeue_entry(redis: aioredis.Redis, run: str, item: Letter) -> Outcome:
    letter = item.letter
    ref = trajectory_ref(letter.payload)
    if ref is not None and not is_entry_id(ref):
        return Outcome(item, "skipped", f"its 'traj' field names no stream entry: {ref[:40]!r}")
    keys = [item.stream, counters_key(run, item.partition), letter.source_stream]
    if ref is not None:
        keys.append(stream_key(run, item.partition, "traj"))
    async with translated_errors("requeueing"):
        pipe = redis.pipeline(transaction=True)
        pipe.xadd(letter.source_stream, letter.payload)  # type: ignore[arg-type]
        pipe.eval(_CLAIM, len(keys), *keys, item.entry_id, DROP_PREFIX + letter.reason,
                  REQUEUED_COUNTER, ref or "")
        new_id, claimed = await pipe.execute()
    if claimed == 0:
        return Outcome(item, "gone", "requeued meanwhile by someone else")
    if claimed == -1:
        return Outcome(item, "skipped", f"the traj entry {ref} it names is gone (trimmed): "
                       "it would only be dead-lettered again as trajectory_missing")
    new_id = new_id.decode() if isinstance(new_id, bytes) else str(new_id)
    log.info("dead_letter_requeued", run=run, entry_id=item.entry_id, reason=letter.reason,
             group_id=item.group_id, stream=letter.source_stream, new_entry_id=new_id)
    return Outcome(item, "requeued", f"re-added to {letter.source_stream} as {new_id}")


async def _requeue_job(redis: aioredis.Redis, run: str, item: Letter) -> Outcome:
    # One script moves the letter to the partition's readmit list; the feeder enqueues it
    # from there within the admission budget, like a new job (see the module docstring).
    keys = [item.stream, counters_key(run, item.partition), readmit_key(run, item.partition)]
    async with translated_errors("requeueing"):
        claimed = await redis.eval(_READMIT, len(keys), *keys, item.entry_id,
                                   DROP_PREFIX + item.letter.reason, REQUEUED_COUNTER,
                                   item.letter.source_id)
    if claimed == 0:
        return Outcome(item, "gone", "requeued meanwhile by someone else")
    log.info("dead_letter_requeued", run=run, entry_id=item.entry_id,
             reason=item.letter.reason, group_id=item.group_id, job=item.letter.source_id)
    return Outcome(item, "requeued", "job waits for admission by the run's feeder")


def payload_summary(payload: Fields) -> dict[str, Any]:
    """What a letter's payload holds: a group's identity and size when it decodes (a
    scored group's rewards too), else why not; plus each field's size in bytes."""
    sizes = {name.decode(errors="replace"): len(value) for name, value in payload.items()}
    if not payload:
        return {"decoded": None, "error": "no payload (a rollout job)", "fields": sizes}
    try:
        message = decode(payload)
    except DecodeError as exc:
        return {"decoded": None, "error": str(exc), "fields": sizes}
    group = message.trajectory if isinstance(message, ScoredGroup) else message
    decoded: dict[str, Any] = {
        "kind": message.kind, "group_id": group.group_id, "run": group.run, "env": group.env,
        "policy_version": group.policy_version, "completions": len(group.completions),
        "prompt_tokens": len(group.prompt_ids), "completion_tokens": group.num_tokens,
        "finish_reasons": [c.finish_reason for c in group.completions],
        "created_at": group.created_at, "finished_at": group.finished_at,
    }
    if isinstance(message, ScoredGroup):
        decoded |= {"rewards": [score.reward for score in message.scores],
                    "reward_config": message.reward_config, "scored_at": message.scored_at}
    return {"decoded": decoded, "error": None, "fields": sizes}


async def letter_in_full(redis: aioredis.Redis, item: Letter) -> dict[str, Any]:
    """A letter in full: every field of the letter, and ``payload_summary`` of its payload
    (a reference-form scored payload joined with its traj entry, while that exists)."""
    letter = item.letter
    payload = letter.payload
    joined_from = None
    if trajectory_ref(payload) is not None:
        # any key of the partition names its traj stream to join_trajectories
        [joined] = await join_trajectories(redis, [(item.stream, payload)])
        if isinstance(joined, str):
            summary = payload_summary(payload) | {"error": f"reference form: {joined}"}
        else:
            joined_from = trajectory_ref(payload)
            summary = payload_summary(joined) | {"fields": payload_summary(payload)["fields"]}
    else:
        summary = payload_summary(payload)
    return {
        "id": item.entry_id, "stream": item.stream, "partition": item.partition,
        "reason": letter.reason, "detail": letter.detail, "group_id": item.group_id,
        "source": item.source, "source_stream": letter.source_stream,
        "source_id": letter.source_id, "consumer_group": letter.consumer_group,
        "deliveries": letter.deliveries, "dead_at": letter.dead_at,
        "payload": summary | {"joined_traj_entry": joined_from},
    }


def _letter(stream: str, entry_id: str, fields: Fields) -> Letter | None:
    try:
        return Letter(stream, entry_id, decode_dead(fields))
    except DecodeError as exc:
        log.warning("dead_entry_unreadable", stream=stream, entry_id=entry_id, error=str(exc))
        return None


def _id_seconds(entry_id: str) -> float | None:
    ms = entry_id.partition("-")[0]
    return int(ms) / 1000 if ms.isdigit() else None


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
