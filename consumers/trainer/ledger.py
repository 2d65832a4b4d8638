"""The trainer's own Redis state: the run registration, the policy version, the seen-hash
and each consumer's trained log. Consumer-group verbs stay in ``consumers.bus``.

    rollq:{<run>}:trainer:seen:<bucket>     hashes: group_id -> "<stream> <entry id>" of the
                                            entry that was trained (dedup across restarts),
                                            one per time bucket, each expiring after the
                                            dedup window
    rollq:{<run>}:trainer:log:<consumer>    stream: one entry per batch this consumer
                                            acked, in ack order; its ``entries`` field is
                                            a JSON list of [group_id, stream, entry id]

Both live under the run's hash tag, so ``record`` updates them in one MULTI.

**Why the seen-set may forget.** It only has to catch a copy of a group that can still
arrive. A copy of group G comes from (a) a re-run of G's rollout job, which arq performs
only while the job is still in its queue: all copies are published within
``max_tries × (job_timeout_s + margins) + back-offs`` of each other (under an hour at the
defaults, and a trained copy was published before it was trained), or (b) ``rollq dead
requeue`` of a dead-lettered copy, which refuses a letter whose entry is older than the
dedup window minus that hour (``--force`` overrides, with the warning). A record kept for
``dedup_window_s`` (6 h by default) after the training therefore outlives every copy that
can still come; older records expire with their time bucket, so the set stays as large as
the groups of one window, not of the whole run. The same window bounds the trained log.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import orjson
import redis.asyncio as aioredis

from rollq.consumers.bus import join_trajectories, translated_errors
from rollq.consumers.trainer.errors import ResumeError
from rollq.schemas import Fields
from rollq.schemas.keys import (
    POLICY_VERSION_FIELD,
    run_key,
    state_key,
)
from rollq.schemas.runs import RunRecord, register_run

SEEN_BUCKETS = 12
"""The dedup window is kept in this many time buckets (one hash each)."""
_CONSUMER_NAME = re.compile(r"^[A-Za-z0-9_.:@\-]{1,128}$")

# KEYS[1] state hash; ARGV[1] field, ARGV[2] new version. Raises the version, never lowers
# it; returns the version in force afterwards.
_RAISE_VERSION = """
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
local step = tonumber(ARGV[2])
if step > current then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return step
end
return current
"""

# KEYS: the seen-set's buckets, newest first; ARGV: group ids. Per id, the value of the
# newest bucket holding it, or false (nil to the client). One script rather than a pipeline
# of an HMGET per bucket: the window's 14 buckets are one command to pack and one reply.
_SEEN = """
local found = {}
for i = 1, #ARGV do found[i] = false end
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    local values = redis.call('HMGET', key, unpack(ARGV))
    for i = 1, #ARGV do
      if not found[i] and values[i] then found[i] = values[i] end
    end
  end
end
return found
"""
_SEEN_IDS_PER_CALL = 1000
"""Group ids per call of the seen script (Lua's ``unpack`` takes a few thousand at most)."""


def check_consumer_name(consumer: str) -> str:
    """Return ``consumer`` unchanged, or raise ValueError (it becomes part of a key name)."""
    if not _CONSUMER_NAME.match(consumer):
        raise ValueError(f"consumer name {consumer!r} is invalid: use 1-128 characters "
                         "from A-Z a-z 0-9 _ . : @ -")
    return consumer


@dataclass(frozen=True)
class TrainedEntry:
    """One group a consumer trained on: its id and the scored entry it came from."""

    group_id: str
    stream: str
    entry_id: str

    @property
    def ref(self) -> str:
        return f"{self.stream} {self.entry_id}"


class Ledger:
    """Reads and writes the trainer's run-wide state for one consumer."""

    def __init__(self, redis: aioredis.Redis, run: str, consumer: str, log_max_len: int,
                 *, dedup_window_s: float = 6 * 3600.0) -> None:
        self.redis = redis
        self.run = run
        self.consumer = consumer
        self.log_max_len = log_max_len
        self.dedup_window_s = dedup_window_s
        self.bucket_s = max(1.0, dedup_window_s / SEEN_BUCKETS)
        self._raise_version = redis.register_script(_RAISE_VERSION)
        self._seen = redis.register_script(_SEEN)

    def log_key(self, consumer: str | None = None) -> str:
        return run_key(self.run, f"trainer:log:{consumer or self.consumer}")

    async def register(self, partitions: int) -> RunRecord:
        """Record the run if new (first writer wins): its partition count, and whether
        this call created it."""
        return await register_run(self.redis, self.run, partitions)

    async def policy_version(self) -> int:
        """The run's published policy version (0 before the first publish)."""
        async with translated_errors("reading the policy version"):
            value = await self.redis.hget(state_key(self.run), POLICY_VERSION_FIELD)
        return int(value) if value is not None else 0

    async def raise_policy_version(self, step: int) -> int:
        """Set the run's policy version to ``step`` unless it is already higher; returns the
        version in force."""
        async with translated_errors("publishing the policy version"):
            result = await self._raise_version(
                keys=[state_key(self.run)], args=[POLICY_VERSION_FIELD, step]
            )
        return int(result)

    def seen_key(self, bucket: int) -> str:
        return run_key(self.run, f"trainer:seen:{bucket}")

    def _bucket(self, now: float | None = None) -> int:
        return int((time.time() if now is None else now) // self.bucket_s)

    async def seen(self, group_ids: Sequence[str]) -> dict[str, str]:
        """Which of ``group_ids`` were trained within the dedup window: group id -> ``ref``
        of that entry (the newest bucket's record wins)."""
        if not group_ids:
            return {}
        newest = self._bucket()
        buckets = [self.seen_key(b) for b in range(newest, newest - SEEN_BUCKETS - 2, -1)]
        found: dict[str, str] = {}
        async with translated_errors("checking seen groups"):
            for start in range(0, len(group_ids), _SEEN_IDS_PER_CALL):
                chunk = list(group_ids[start:start + _SEEN_IDS_PER_CALL])
                values = await self._seen(keys=buckets, args=chunk)
                found.update((group_id, _text(value))
                             for group_id, value in zip(chunk, values, strict=True)
                             if value is not None)
        return found

    async def record(self, entries: Sequence[TrainedEntry]) -> str | None:
        """Mark ``entries`` trained (seen-hash) and append them to this consumer's log as one
        log entry, in one transaction; returns that log entry's id."""
        if not entries:
            return None
        listed = orjson.dumps([[e.group_id, e.stream, e.entry_id] for e in entries])
        now = time.time()
        key = self.seen_key(self._bucket(now))
        async with translated_errors("recording trained groups"):
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(key, mapping={e.group_id: e.ref for e in entries})
            # the bucket outlives its last write by the whole window
            pipe.expire(key, int(self.dedup_window_s + 2 * self.bucket_s) + 1)
            pipe.xadd(self.log_key(), {"entries": listed},
                      maxlen=self.log_max_len, approximate=True)
            pipe.xtrim(self.log_key(),
                       minid=f"{int((now - self.dedup_window_s) * 1000)}-0", approximate=True)
            replies = await pipe.execute()
        return _text(replies[-2])

    async def log_head(self) -> str:
        """Id of the last entry of this consumer's log, ``0-0`` when empty."""
        async with translated_errors("reading the trained log"):
            last = await self.redis.xrevrange(self.log_key(), count=1)
        return _text(last[0][0]) if last else "0-0"

    async def log_since(self, consumer: str, after: str) -> list[TrainedEntry]:
        """Entries of ``consumer``'s log after id ``after``, oldest first.

        Raises ResumeError when the log no longer holds ``after`` itself: entries after it
        may have been trimmed, and replaying only some of them would skip groups.
        """
        key = self.log_key(consumer)
        found: list[TrainedEntry] = []
        async with translated_errors("reading the trained log"):
            if after != "0-0" and not await self.redis.xrange(key, min=after, max=after):
                raise ResumeError(
                    f"trained log {key} no longer holds checkpoint position {after}: it was "
                    "trimmed or deleted (raise log_max_len above the batches acked between "
                    "checkpoints)"
                )
            start = after
            while True:
                page = await self.redis.xrange(key, min=start, count=1000)
                page = [(i, f) for i, f in page if _text(i) != start or start == "0-0"]
                if not page:
                    return found
                for _, fields in page:
                    found += _logged(fields)
                start = _text(page[-1][0])

    async def fetch(self, entries: Sequence[TrainedEntry]) -> list[Fields | str]:
        """The scored-stream fields of each entry in inline form (joined with its traj
        entry); where they are gone, why: ``""`` when the scored entry itself was trimmed,
        else what is wrong with its trajectory."""
        if not entries:
            return []
        async with translated_errors("fetching entries to replay"):
            pipe = self.redis.pipeline(transaction=False)
            for entry in entries:
                pipe.xrange(entry.stream, min=entry.entry_id, max=entry.entry_id, count=1)
            replies = await pipe.execute()
        found = [(e.stream, dict(r[0][1])) for e, r in zip(entries, replies, strict=True) if r]
        joined = iter(await join_trajectories(self.redis, found))
        return [next(joined) if reply else "" for reply in replies]


def _logged(fields: dict[bytes, bytes]) -> list[TrainedEntry]:
    """The groups of one log entry: a batch, or one group as logs before batching wrote."""
    if b"entries" not in fields:
        return [TrainedEntry(_text(fields[b"group_id"]), _text(fields[b"stream"]),
                             _text(fields[b"entry_id"]))]
    try:
        listed = orjson.loads(fields[b"entries"])
        return [TrainedEntry(str(g), str(s), str(i)) for g, s, i in listed]
    except (orjson.JSONDecodeError, TypeError, ValueError) as exc:
        raise ResumeError(f"unreadable trained log entry: {exc!r}") from exc


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
